"""``octlm bench``: every measurement in a fresh process, every result one record (DESIGN §5).

- :mod:`octlm.bench.suites`: the named grids of measurements (``seed``, ``train``, ...).
- :mod:`octlm.bench.driver`: spawns one worker per measurement; faults, resume, progress.
- :mod:`octlm.bench.worker`: runs exactly one measurement and prints one JSON line.
- :mod:`octlm.bench.memory`: the memory probes and the score-matrix estimate.

A fresh process per measurement because ``ru_maxrss`` is a lifetime peak: the seed saw one
backend's peak leak into the next row when they shared a process.
"""
