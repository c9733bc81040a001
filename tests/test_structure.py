"""The shape of the code: no import cycles, one flatten per call, private
torch_xla calls in one module, and every docstring example runs."""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib
import re

import optree
import pytest
import torch

import xcoll

ROOT = pathlib.Path(xcoll.__file__).parent


#: xcoll's folders, from the bottom up: a module imports from its own folder
#: and those below it, never from one above (docs/design.md, "Layers"); the
#: top level's private modules (``xcoll._collectives``, ...) come last.
FOLDERS = ["xcoll._base", "xcoll._encode", "xcoll._backends", "xcoll._guard", "xcoll._core", "xcoll"]

#: Within each folder, its modules from the bottom up: each imports only
#: earlier ones of its folder (and any of a folder below).
LAYERS = {
    "xcoll._base": [["xcoll._base"], ["xcoll._base.memo"], ["xcoll._base.tree"]],
    "xcoll._encode": [
        ["xcoll._encode"],
        ["xcoll._encode.pack", "xcoll._encode.wire", "xcoll._encode.codec"],
    ],
    "xcoll._backends": [
        ["xcoll._backends.base", "xcoll._backends._xlac", "xcoll._backends._launch"],
        ["xcoll._backends.xla_step"],
        ["xcoll._backends.xla_kernels"],
        ["xcoll._backends.xla", "xcoll._backends.dist", "xcoll._backends.hosted"],
        ["xcoll._backends"],
    ],
    "xcoll._guard": [
        ["xcoll._guard"],
        ["xcoll._guard.watchdog", "xcoll._guard.steps"],
        ["xcoll._guard.exchange"],
        ["xcoll._guard.check"],
        ["xcoll._guard.header"],
        ["xcoll._guard.verdict"],
        ["xcoll._guard.leaving"],
        ["xcoll._guard.order"],
        ["xcoll._guard.entry"],
    ],
    "xcoll._core": [
        ["xcoll._core"],
        ["xcoll._core.recipe", "xcoll._core.pending"],
        ["xcoll._core.execute"],
        ["xcoll._core.ops.base"],
        ["xcoll._core.ops.parts"],
        ["xcoll._core.ops.reduce"],
        ["xcoll._core.ops.reduce_scatter"],
        ["xcoll._core.ops.gather"],
        ["xcoll._core.ops.all_to_all", "xcoll._core.ops.broadcast"],
        ["xcoll._core.ops"],
        ["xcoll._core.call"],
        ["xcoll._core.uneven.rows"],
        ["xcoll._core.uneven.exact", "xcoll._core.uneven.padded"],
        ["xcoll._core.uneven"],
        ["xcoll._core.grad"],
        ["xcoll._core.traced"],
    ],
    "xcoll": [["xcoll._samples"], ["xcoll._collectives"], ["xcoll._objects", "xcoll._rng", "xcoll._step"]],
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """xcoll modules that ``name`` imports anywhere (functions included). A
    package's implicit import by its submodules is not an edge."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the submodule mod, else pkg itself
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def test_no_import_cycles_even_inside_functions():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # the folders, then each folder's modules, in order: each imports only
    # earlier ones (a folder's, then its own layer's)
    seen: set[str] = set()
    for folder in FOLDERS:
        for layer in LAYERS[folder]:
            for m in layer:
                assert graph[m] <= seen | set(layer) - {m}, (m, graph[m] - seen)
            seen |= set(layer)
    assert seen == {m for m in graph if m.startswith("xcoll._")}


#: The most lines a function of xcoll/ may have, its docstring aside (public
#: docstrings carry Args, Returns, Raises and an example).
LONGEST = 60


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    doc = first.end_lineno - first.lineno + 1 if docstring and first.end_lineno else 0
    return (node.end_lineno or node.lineno) - node.lineno + 1 - doc


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({_length(node)} lines)"
        for path in sorted(ROOT.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _length(node) > LONGEST
    ]
    assert not long, long


def test_private_torch_xla_calls_live_in_one_module():
    private = re.compile(r"_XLAC|torch_xla\._internal|runtime\._\w")
    users = sorted(
        str(p.relative_to(ROOT.parent))
        for p in ROOT.rglob("*.py")
        if private.search(p.read_text()) and p.name != "_xlac.py"
    )
    assert users == []


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples_run(name):
    if name.startswith("xcoll._backends.xla") or name == "xcoll._backends._xlac":
        pytest.importorskip("torch_xla")
    if name == "xcoll.integrations.torchmetrics":
        pytest.importorskip("torchmetrics")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_the_public_functions_have_examples():
    for name in ["gather", "reduce", "broadcast", "gather_object", "broadcast_object", "barrier"]:
        assert ">>>" in getattr(xcoll, name).__doc__, name


_TRAVERSALS = [
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_flatten_with_accessor",
    "tree_leaves",
    "tree_structure",
    "tree_map",
    "tree_paths",
    "tree_broadcast_prefix",
]


class _CountFlattens:
    """Counts optree traversals of one tree object (the public call's input),
    by any of optree's functions that walk a whole tree."""

    def __init__(self, monkeypatch, tree):
        self.count, self.tree = 0, tree
        for name in _TRAVERSALS:
            monkeypatch.setattr(optree, name, self._counting(getattr(optree, name)))

    def _counting(self, original):
        def counting(*args, **kwargs):
            self.count += sum(a is self.tree for a in args)
            return original(*args, **kwargs)

        return counting


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize(
    "call",
    [
        lambda t: xcoll.gather(t),
        lambda t: xcoll.gather(t, dim=0, uneven=True),
        lambda t: xcoll.gather(t, max_size=4),
        lambda t: xcoll.reduce(t, {"a": "mean", "b": {"c": "max", "d": "sum"}}),
        lambda t: xcoll.broadcast(t, src=0),
        lambda t: xcoll.gather(t, grad=True),
        lambda t: xcoll.reduce(t, "mean", grad=True),
        lambda t: xcoll.broadcast(t, src=0, grad=True),
        lambda t: xcoll.gather(t, max_size=4, grad=True),
    ],
    ids=[
        "gather",
        "uneven",
        "max_size",
        "reduce",
        "broadcast",
        "gather-grad",
        "reduce-grad",
        "broadcast-grad",
        "max_size-grad",
    ],
)
def test_each_call_flattens_its_tree_once_and_resolves_its_backend_once(monkeypatch, call, mode):
    # the first call plans (and describes) the tree, the second finds the plan
    # cached; grad=True included (its forward runs on the one flattened tree,
    # on the backend its call resolved)
    tree = {"a": torch.ones(3, requires_grad=True), "b": {"c": torch.ones(2, 2), "d": 2.5}}
    xcoll._core.call._plans._values.clear()
    counter = _CountFlattens(monkeypatch, tree)
    resolved = []
    resolve = xcoll._backends.resolve
    monkeypatch.setattr(
        xcoll._backends, "resolve", lambda *a, **k: resolved.append(a) or resolve(*a, **k)
    )
    with xcoll.consistency_checks(mode):
        call(tree)
        call(tree)
    assert counter.count == 2
    assert len(resolved) == 2


def test_the_mutation_pass_names_modules_and_test_files_that_exist():
    """tests/mutation.py's module list is mutmut's (pyproject.toml's
    ``only_mutate``), in its order, and true to the tree as files move; each
    test file it credits with calls that mutmut cannot see is in the pass's
    selection."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11 and later")
    from tests.mutation import MODULES, OWNERS

    top = ROOT.parent
    config = tomllib.loads((top / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert list(MODULES) == config["only_mutate"]
    assert [m for m in MODULES if not (top / m).is_file()] == []
    selection = config["pytest_add_cli_args_test_selection"]
    assert [f for f in OWNERS if f not in selection or not (top / f).is_file()] == []


def _table_rows() -> list[str]:
    """The first cells of docs/design.md's table of modules, in order."""
    text = (ROOT.parent / "docs" / "design.md").read_text()
    table = text[text.index("| module | holds |") :].split("\n\n", 1)[0]
    return [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]


def _named_by(row: str) -> str:
    """The module a first cell names, or the folder (``xcoll._core.ops/``)."""
    name = row.removesuffix(".py").removesuffix("/__init__").rstrip("/").replace("/", ".")
    return name + "/" if row.endswith("/") else name


def test_the_design_docs_table_of_modules_names_every_private_module_bottom_up():
    # (before: the core listed before the guard, the encodings and the
    # engines it imports, and two modules of the engines missing)
    rows = [_named_by(r) for r in _table_rows()]
    place = {name: i for i, name in enumerate(rows)}
    order = []
    for folder in FOLDERS:
        order.append(folder + "/")
        for layer in LAYERS[folder]:
            for m in layer:
                # (a package and the modules of a subfolder are named by its folder's row)
                named = [p for p in (m, m + "/", m.rpartition(".")[0] + "/") if p in place]
                assert named, f"{m} is in no row of docs/design.md's table"
                order.append(named[0])
    seen = [place[name] for name in order]
    assert seen == sorted(seen), [rows[i] for i in seen]


def _defined(path: pathlib.Path) -> set[str]:
    """The names a module defines: its classes, functions, arguments, and
    the names and attributes it assigns."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def test_the_glossary_names_an_identifier_that_its_file_defines():
    # (one name per idea: a term whose identifier is renamed or moved fails here)
    text = (ROOT.parent / "docs" / "design.md").read_text()
    table = text[text.index("| term | meaning |") :].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[c.strip().strip("`") for c in line.split("|")[1:-1]] for line in table]
    assert len(rows) >= 20, rows
    missing = [
        (term, ident, file)
        for term, _, ident, file in rows
        if not (ROOT.parent / file).is_file() or ident not in _defined(ROOT.parent / file)
    ]
    assert not missing, missing
    assert len({r[0] for r in rows}) == len(rows), "a term appears twice"


def _tests_defined() -> dict[str, set[str]]:
    """Each test function of tests/, with the files that define it."""
    defined: dict[str, set[str]] = {}
    for path in sorted((ROOT.parent / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined.setdefault(node.name, set()).add(path.name)
    return defined


def test_every_test_a_document_names_exists_in_the_file_it_names():
    # (a promise in README.md or docs/ is held by the test it names: one
    # renamed, moved or deleted leaves the promise unheld, and fails here)
    defined = _tests_defined()
    modules = {p.stem for p in (ROOT.parent / "tests").glob("test_*.py")}
    named, missing = 0, []
    for doc in [ROOT.parent / "README.md", *sorted((ROOT.parent / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"(?:(tests/[\w/]+\.py)::)?(test_\w+)", text):
            file, name = m.group(1), m.group(2)
            if name in modules:  # (a test file, named as such)
                continue
            named += 1
            if name not in defined or (file and pathlib.Path(file).name not in defined[name]):
                missing.append(f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not missing, missing
    assert named > 150, named  # (the documents do name their tests)


def test_the_backend_boundarys_docstring_names_every_public_member_of_its_two_halves():
    # (before: it named 11 of Transport's 30 members; an engine written from
    # it would have missed flush, defer, settle, fetch, ...)
    from xcoll._backends import base

    for half in (base.Transport, base.Kernels):
        # (not mutmut's copies of a mutated class's methods, named
        # ``xǁClassǁmethod__mutmut_N``, which the mutation pass runs this test on)
        members = [n for n in vars(half) if not n.startswith("_") and "ǁ" not in n]
        members += [n for n in half.__annotations__ if not n.startswith("_")]
        missing = [n for n in members if f"``{n}``" not in (base.__doc__ or "")]
        assert not missing, (half.__name__, missing)


def test_each_private_packages_docstring_names_each_of_its_modules():
    # (before: xcoll._core's omitted pending)
    for folder in FOLDERS[:-1]:
        package = importlib.import_module(folder)
        for layer in LAYERS[folder]:
            for m in layer:
                if m.count(".") == folder.count(".") + 1:  # (its own modules, not a subfolder's)
                    assert m.rpartition(".")[2] in (package.__doc__ or ""), (folder, m)
