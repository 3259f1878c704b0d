"""``octlm bench``: each measurement in a fresh process, each result one record.

Records: docs/design.md, 'Records'.

- :mod:`octlm.lab.bench.suites`: the named grids of measurements (``baseline``, ``train``, ...),
  and the program suites (``PROGRAMS``) that take their own options.
- :mod:`octlm.lab.bench.timing`: the one timing loop every suite uses.
- :mod:`octlm.lab.bench.driver`: spawns one worker per measurement, in rounds; faults, resume.
- :mod:`octlm.lab.bench.worker`: runs exactly one measurement and prints one JSON line.
- :mod:`octlm.lab.bench.guard`: children die with their driver; stop signals end a command cleanly;
  the busy mode's competing process.
- :mod:`octlm.lab.bench.score_memory`: the score-matrix estimate (the probes are
  :mod:`octlm.memory`'s).
- :mod:`octlm.lab.bench.decode`, :mod:`~octlm.lab.bench.documents`, :mod:`~octlm.lab.bench.ring`,
  :mod:`~octlm.lab.bench.training`: the program suites (decoding, packed documents, ring
  attention over several processes, ``octlm train`` itself).
- :mod:`octlm.lab.bench.sketch`: the blocking sketch tiled attention grew from.

A fresh process per measurement because ``ru_maxrss`` is a lifetime peak: backends measured
one after another in one process would each report the largest peak so far.
"""
