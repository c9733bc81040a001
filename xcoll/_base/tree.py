"""Pytree handling: flattening, leaf kinds, and the paths that errors name.

Leaves are flattened with optree's deterministic order (dict keys sorted), so
replicas that built the same dict in different insertion orders send their leaves
in the same order. Keys it cannot sort keep their insertion order: where two of
them read the same, nothing could match them across replicas, and such a tree
is refused. ``None`` is structure, not a leaf. A call flattens its tree
once (:func:`flatten`); everything after works on the :class:`Flat`.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from . import memo as _memo

#: Tensor dtypes every backend can move exactly. (Complex and the unsigned
#: 16/32/64-bit types are refused rather than half supported.)
SUPPORTED_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

#: Object addresses in reprs (a function used as a dict key, a defaultdict's
#: factory): they differ between processes, so descriptions compared across
#: replicas leave them out.
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Flat:
    """A flattened tree: ``leaves[i]`` is a tensor or a Python scalar.

    ``signature`` holds what a call's plan depends on, one entry per leaf: a
    tensor's ``(dtype, shape, device, layout, requires_grad)``, a Python scalar's type.
    ``devices`` are the distinct devices of the tensor leaves, in order of
    appearance; ``scalars`` the indices of the Python scalar leaves,
    ``tensors`` those of the tensor leaves, ``zero_d`` those of the 0-d ones.

    >>> flat = flatten({"b": [torch.zeros(2), 3], "a": 1.5})
    >>> flat.paths
    ["tree['a']", "tree['b'][0]", "tree['b'][1]"]
    >>> flat.scalars
    (0, 2)
    """

    tree: Any
    leaves: list[Any]
    treespec: optree.PyTreeSpec
    signature: tuple
    #: ``(treespec, signature)``: equal for trees of the same structure, leaf
    #: types, dtypes, shapes and devices. (It cannot be hashed if the treespec
    #: holds an unhashable object: then caches keyed by it build per call.)
    key: tuple
    devices: tuple[torch.device, ...]
    scalars: tuple[int, ...]
    tensors: tuple[int, ...] = ()
    zero_d: tuple[int, ...] = ()
    #: Whether a tensor leaf requires grad (whose copies autograd would record).
    grads: bool = False

    @functools.cached_property
    def paths(self) -> list[str]:
        """Each leaf's Python expression from the root, e.g. ``tree['preds'][2]``
        (all of them in one pass over the treespec)."""
        return _paths(self.treespec)

    def path(self, i: int) -> str:
        return self.paths[i]

    def unflatten(self, leaves: list[Any]) -> Any:
        return optree.tree_unflatten(self.treespec, leaves)


def _paths(treespec: optree.PyTreeSpec) -> list[str]:
    return [a.codify("tree") for a in treespec.accessors()]


# (treespec, signature) of trees already checked -> (the indices of their Python
# int leaves, whose range is checked on every call; their tensor devices; the
# indices of their Python scalars, tensors and 0-d tensors).
_checked: _memo.Memo[tuple] = _memo.Memo()


def flatten(tree: Any) -> Flat:
    """Flattens ``tree`` and checks every leaf, before anything is communicated.

    A tree whose structure and leaf signatures were checked before is only
    checked again for the values of its Python ints.

    Raises:
        TypeError: a leaf is not a tensor, bool, int or float, or is a tensor
            xcoll cannot move (dtype, layout, nested, meta); the message names
            the leaf's path; or a dict's keys keep their insertion order and
            two of them read the same (the dict's path is named).
        ValueError: a Python int does not fit in int64, or the tree nests deeper
            than optree flattens (the path to that depth is named).
    """
    try:
        leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False)
    except RecursionError:
        raise ValueError(
            f"{_deep_path(tree)}: the tree nests deeper than {optree.MAX_RECURSION_DEPTH} "
            "levels, more than optree flattens"
        ) from None
    try:
        # per leaf: (dtype, shape, device, layout, requires_grad) of a tensor, a scalar's type
        signature: tuple[Any, ...] = tuple(
            [
                (leaf.dtype, leaf.shape, leaf.device, leaf.layout, leaf.requires_grad)
                if isinstance(leaf, torch.Tensor)
                else type(leaf)
                for leaf in leaves
            ]
        )
    except RuntimeError:  # a tensor without sizes (nested): named by the check
        _check(leaves, treespec)
        raise

    def check() -> tuple:
        _check(leaves, treespec)
        _check_key_order(treespec, leaves)
        scalars = tuple(i for i, s in enumerate(signature) if not isinstance(s, tuple))
        ints = [i for i in scalars if issubclass(signature[i], int) and signature[i] is not bool]
        devices = tuple(dict.fromkeys(s[2] for s in signature if isinstance(s, tuple)))
        tensors = tuple(i for i, s in enumerate(signature) if isinstance(s, tuple))
        zero_d = tuple(i for i in tensors if not signature[i][1])
        grads = any(signature[i][4] for i in tensors)
        return ints, devices, scalars, tensors, zero_d, grads

    key = (treespec, signature)
    known = _checked.get(key, check)
    flat = Flat(tree, leaves, treespec, signature, key, *known[1:])
    for i in known[0]:
        if not _INT64_MIN <= leaves[i] <= _INT64_MAX:
            raise ValueError(f"{flat.path(i)}: Python int {leaves[i]} does not fit in int64")
    return flat


def _check(leaves: list[Any], treespec: optree.PyTreeSpec) -> None:
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            problem = _tensor_problem(leaf)
        elif isinstance(leaf, (bool, int, float)):
            continue
        else:
            problem = (
                f"unsupported leaf of type {type(leaf).__qualname__}; "
                "xcoll communicates tensors and Python bool/int/float (None is structure)"
            )
        if problem:
            raise TypeError(f"{_paths(treespec)[i]}: {problem}")


def _check_key_order(treespec: optree.PyTreeSpec, leaves: list[Any]) -> None:
    """Refuses a dict whose leaves no replica can match by key: keys that
    keep their insertion order, two of which read the same without their
    addresses. Replicas that inserted them in different orders would pair one
    key's values with the other's, and descriptions, which leave addresses
    out, could not tell (with keys that read differently, they can)."""
    found: list[bool] = []

    def node(kind: type, data: Any, children: Any) -> None:
        if not found and _twin_keys(kind, data) is not None:
            found.append(True)

    # optree's walk, with a Python call per node: about 90 us for 500 nodes,
    # paid once per treespec (flatten caches it with the other checks)
    treespec.walk(leaves, f_node=node)
    if found:
        path, kind, twin = _first_twin_keys(treespec)
        order = (
            "an OrderedDict's keys keep their insertion order"
            if kind is collections.OrderedDict
            else "keys that cannot be sorted keep their insertion order"
        )
        raise TypeError(
            f"{path}: {order}, and two of them read {twin} (without their addresses, "
            "which differ between processes): replicas that inserted them in different "
            "orders would exchange their values, and no check can tell. Use keys that sort "
            "(str, int) or whose repr tells them apart"
        )


def _twin_keys(kind: type, data: Any) -> str | None:
    """The repr (addresses left out) that two keys of a mapping node share,
    where the node keeps their insertion order; else None. ``data`` is the
    node's data as optree gives it (a defaultdict's: its factory and keys)."""
    if kind is collections.defaultdict:
        data = data[1]
    elif kind is not dict and kind is not collections.OrderedDict:
        return None
    if len(data) < 2 or (kind is not collections.OrderedDict and _sorts(data)):
        return None
    seen: set[str] = set()
    for key in data:
        text = ADDRESS.sub("", repr(key))
        if text in seen:
            return text
        seen.add(text)
    return None


def _sorts(keys: list[Any]) -> bool:
    """Whether optree sorted these dict keys (``optree.utils.total_order_sorted``:
    by the keys, else by their types' names and the keys, else not at all)."""
    for order in (None, lambda k: (f"{type(k).__module__}.{type(k).__qualname__}", k)):
        try:
            sorted(keys, key=order)
            return True
        except TypeError:
            pass
    return False


def _first_twin_keys(treespec: optree.PyTreeSpec) -> tuple[str, type, str]:
    """The path, type and shared key repr of the first node :func:`_twin_keys`
    refuses (an error's slow path: walks the treespec in Python)."""
    stack: list[tuple[optree.PyTreeSpec, tuple[Any, ...]]] = [(treespec, ())]
    while stack:
        spec, steps = stack.pop()
        if spec.is_leaf() or not spec.num_children:
            continue
        assert spec.type is not None  # (a leaf's is None)
        entries = spec.entries()
        data = (None, entries) if spec.type is collections.defaultdict else entries
        twin = _twin_keys(spec.type, data)
        if twin is not None:
            return _short_path(steps), spec.type, twin
        entry = optree.register_pytree_node.get(spec.type, namespace=spec.namespace)
        assert entry is not None  # (every node type of a treespec is registered)
        stack.extend(
            (child, (*steps, entry.path_entry_type(e, spec.type, spec.kind)))
            for e, child in reversed(list(zip(entries, spec.children(), strict=True)))
        )
    raise AssertionError("no twin keys found")  # _check_key_order found one


def _short_path(entries: tuple[Any, ...]) -> str:
    return _path(entries, "tree")


def _shown(steps: Any) -> tuple[str, ...]:
    """The first and last few steps of a path: a full one is as long as the
    tree is deep."""
    steps = tuple(steps)
    return steps if len(steps) <= 8 else (*steps[:4], "...", *steps[-2:])


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.dtype not in SUPPORTED_DTYPES:
        return (
            f"dtype {t.dtype} is not supported; xcoll moves "
            f"{', '.join(sorted(str(d) for d in SUPPORTED_DTYPES))}"
        )
    if t.is_nested:
        return "nested tensors are not supported; pass their components (t.unbind())"
    if t.is_sparse or t.layout != torch.strided:
        return "only strided (dense) tensors are supported"
    if t.device.type == "meta":
        return "a meta tensor holds no data to communicate"
    return None


def _deep_path(tree: Any) -> str:
    """The path to the first node deeper than optree flattens (its first and
    last few steps: the full path is as long as the tree is deep)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    steps: tuple[str, ...] = ()
    while stack:
        node, steps = stack.pop()
        if len(steps) > optree.MAX_RECURSION_DEPTH:
            break
        if node is None or optree.tree_is_leaf(node, none_is_leaf=False):
            continue
        children, _, entries, _ = optree.tree_flatten_one_level(node, none_is_leaf=False)
        stack.extend(
            (c, (*steps, f"[{e!r}]"))
            for e, c in reversed(list(zip(entries, children, strict=True)))
        )
    return "tree" + "".join(_shown(steps))


def dtype_of(leaf: Any) -> torch.dtype:
    """The dtype a leaf travels as (a Python scalar's: :func:`scalar_dtype`)."""
    return leaf.dtype if isinstance(leaf, torch.Tensor) else scalar_dtype(leaf)


def scalar_dtype(value: bool | int | float) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.float64


def to_python(value: torch.Tensor, like: bool | int | float) -> bool | int | float:
    """A 0-d CPU tensor back to the Python type of ``like``."""
    if isinstance(like, bool):
        return bool(value.item())
    if isinstance(like, int):
        return int(value.item())
    return float(value.item())


def prefix_key(prefix: Any) -> Hashable:
    """A key for a prefix tree (e.g. of reductions) that hashes whenever its
    leaves do: the str itself, or its treespec and leaves."""
    if isinstance(prefix, str):
        return prefix
    leaves, spec = optree.tree_flatten(prefix, none_is_leaf=False)
    return (spec, tuple(leaves))


def broadcast_prefix(prefix: Any, flat: Flat, what: str) -> list[Any]:
    """Expands a prefix tree (e.g. of reductions) to one entry per leaf of ``flat``."""
    if isinstance(prefix, str):
        return [prefix] * len(flat.leaves)
    # against a skeleton of the tree (leaf indices): the tree is flattened once per call
    skeleton = flat.unflatten(list(range(len(flat.leaves))))
    try:
        full = optree.tree_broadcast_prefix(prefix, skeleton, none_is_leaf=False)
    except ValueError as e:
        # (optree's own text shows the skeleton's leaf indices: "got {'a': 0}")
        where = _parting(optree.tree_structure(prefix, none_is_leaf=False), flat.treespec, what)
        raise ValueError(
            f"{what} must be a str or a prefix tree of the data tree: {where or e}"
        ) from None
    entries = optree.tree_leaves(full, none_is_leaf=False)
    if len(entries) != len(flat.leaves):
        raise ValueError(f"{what} must be a str or a prefix tree of the data tree")
    return entries


def _parting(prefix: optree.PyTreeSpec, data: optree.PyTreeSpec, what: str) -> str | None:
    """Where a prefix tree ``what`` first parts from the data tree, in words
    (an error's slow path: walks both treespecs in Python); None if it does
    not (optree refused it for a reason this walk does not see)."""
    stack: list[tuple[optree.PyTreeSpec, optree.PyTreeSpec, tuple[Any, ...]]] = [(prefix, data, ())]
    while stack:
        p, d, steps = stack.pop()
        if p.is_leaf():  # a leaf of the prefix stands for the whole subtree
            continue
        if d.is_leaf() or p.type is not d.type or p.entries() != d.entries():
            mine, theirs = _path(steps, what), _path(steps, "tree")
            return f"{mine} is {_node(p)}, where the data tree has {_node(d)} at {theirs}"
        assert p.type is not None  # (a leaf's is None)
        entry = optree.register_pytree_node.get(p.type, namespace=p.namespace)
        assert entry is not None  # (every node type of a treespec is registered)
        stack.extend(
            (pc, dc, (*steps, entry.path_entry_type(e, p.type, p.kind)))
            for e, pc, dc in reversed(
                list(zip(p.entries(), p.children(), d.children(), strict=True))
            )
        )
    return None


def _path(entries: tuple[Any, ...], root: str) -> str:
    return root + "".join(_shown([optree.PyTreeAccessor((e,)).codify("") for e in entries]))


def _node(spec: optree.PyTreeSpec) -> str:
    """A treespec's root node in words: ``a leaf``, ``None``, ``a dict with
    keys ['a', 'b']``, ``a list of 2``, ..."""
    kind = spec.type
    if kind is None:  # (a leaf's)
        return "a leaf"
    if kind is type(None):
        return "None"
    if issubclass(kind, dict):
        return f"a {kind.__qualname__} with keys {list(spec.entries())}"
    return f"a {kind.__qualname__} of {spec.num_children}"
