"""The core layer: what a call does and runs. The collectives, one op
object each (:mod:`~xcoll._core.ops`), a call's steps
(:mod:`~xcoll._core.call`), plans and recipes (:mod:`~xcoll._core.recipe`), the
executor (:mod:`~xcoll._core.execute`), uneven gathers
(:mod:`~xcoll._core.uneven`), the tree: flattening, leaf kinds, paths
(:mod:`~xcoll._core.tree`), and the cache of what is built once per key
(:mod:`~xcoll._core.memo`).

Nothing is imported here: the modules import each other and the other layers,
and an import here would make a cycle."""
