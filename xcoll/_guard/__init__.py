"""The guard layer: how replicas that disagree are caught. The per-call guard
header (:mod:`~xcoll._guard.header`), its verdict (what arrived read and
checked, the error it raises) and the watchdog's diagnosis
(:mod:`~xcoll._guard.verdict`), a public call's entry
(:mod:`~xcoll._guard.entry`),
the full consistency check (:mod:`~xcoll._guard.check`), small exchanges run on
their own (:mod:`~xcoll._guard.exchange`), the watchdog
(:mod:`~xcoll._guard.watchdog`), step tags (:mod:`~xcoll._guard.steps`),
the calls in flight (:mod:`~xcoll._guard.order`) and the word of a replica
that left (:mod:`~xcoll._guard.leaving`).

Nothing is imported here: the modules import each other and the other layers,
and an import here would make a cycle."""
