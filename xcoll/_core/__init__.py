"""The core layer: what a call does and runs. The collectives, one op
object each (:mod:`~xcoll._core.ops`), a call's steps
(:mod:`~xcoll._core.call`), plans and recipes (:mod:`~xcoll._core.recipe`), the
executor (:mod:`~xcoll._core.execute`), the outputs of calls in flight
(:mod:`~xcoll._core.pending`), uneven gathers
(:mod:`~xcoll._core.uneven`), differentiable calls (:mod:`~xcoll._core.grad`), calls traced by
torch.compile (:mod:`~xcoll._core.traced`).
The tree and the memo are the base layer's (:mod:`xcoll._base`).

Nothing is imported here: the modules import each other and the other layers,
and an import here would make a cycle."""
