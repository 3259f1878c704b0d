"""The lab: what measures octlm, never what octlm needs to run.

- :mod:`octlm.lab.bench`: ``octlm bench``, one fresh process per measurement, one record each.
- :mod:`octlm.lab.report`: ``octlm report``, every table and plot computed from records.
- :mod:`octlm.lab.verify`: ``octlm verify``, the equivalence experiments.

The lab imports the product (attention, model, training, records); no module outside the lab
imports it, but the command line, which is the door to both.
"""
