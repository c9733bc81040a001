"""The base layer, below every other: the tree (flattening, leaf kinds, the
paths that errors name: :mod:`~xcoll._base.tree`) and the cache of what is
built once per key (:mod:`~xcoll._base.memo`). It imports nothing of
xcoll's other layers."""
