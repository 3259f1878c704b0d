"""``octlm bench``: each measurement in a fresh process, each result one record.

Records: docs/design.md §5.

- :mod:`octlm.bench.suites`: the named grids of measurements (``baseline``, ``train``, ...).
- :mod:`octlm.bench.driver`: spawns one worker per measurement, in rounds; faults, resume.
- :mod:`octlm.bench.worker`: runs exactly one measurement and prints one JSON line.
- :mod:`octlm.bench.guard`: workers die with their driver; the busy mode's competing process.
- :mod:`octlm.bench.memory`: the memory probes and the score-matrix estimate.
- :mod:`octlm.bench.ring`: ring attention over several processes.

A fresh process per measurement because ``ru_maxrss`` is a lifetime peak: backends measured
one after another in one process would each report the largest peak so far.
"""
