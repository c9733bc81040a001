"""Complete programs that use xcoll, shipped with the package so that they run
from an installed wheel: :mod:`xcoll.examples.eval_loop` (what
``python -m xcoll.demo`` runs)."""
