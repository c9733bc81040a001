"""Writes docs/api.md, xcoll's API reference, from the docstrings of every
name in ``xcoll.__all__`` and ``xcoll.testing.__all__``::

    python docs/make_api.py          # (re)writes docs/api.md
    python docs/make_api.py --check  # exits 1 if docs/api.md is not what it would write

Docstrings follow one form (Google style): a summary, prose, then the
sections ``Args:`` (one ``name: text`` entry per parameter, in order),
``Returns:``, ``Raises:`` (one ``ExceptionType: when`` entry each) and, for
classes, ``Attributes:``, then a doctested example (``>>>`` lines, run by
tests/test_demo_and_docs.py). The script refuses a public function, method
or class whose docstring lacks a section it needs or whose ``Args:`` do not
name its parameters, so the reference never silently omits one
(tests/test_api_reference.py runs it).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
MODULES = ("xcoll", "xcoll.testing")
SECTIONS = ("Args", "Returns", "Raises", "Attributes")
WIDTH = 88  # a signature longer than this gets one parameter per line


_ENTRY = re.compile(r"^(\**[A-Za-z_][\w.]*): ?(.*)$")


class DocError(Exception):
    """Public docstrings that do not have the sections the reference needs."""


@dataclass
class Doc:
    """A docstring, parsed: its prose, its sections and its example."""

    prose: list[str] = field(default_factory=list)
    sections: dict[str, list[str]] = field(default_factory=dict)
    example: list[str] = field(default_factory=list)

    def entries(self, section: str) -> list[tuple[str, str]]:
        """A section's ``name: text`` entries (continuation lines indented
        more); none where its first line is not one (free text, e.g. a
        ``Raises:`` that says why nothing is raised)."""
        out: list[tuple[str, str]] = []
        for line in self.sections.get(section, []):
            entry = _ENTRY.match(line)
            if entry:
                out.append((entry.group(1), entry.group(2).strip()))
            elif not out:
                return []
            elif line.strip():
                out[-1] = (out[-1][0], f"{out[-1][1]} {line.strip()}".strip())
        return out

    def text(self, section: str) -> str:
        return " ".join(line.strip() for line in self.sections.get(section, []))


def parse(doc: str) -> Doc:
    """``doc`` (as :func:`inspect.cleandoc` leaves it) split into prose,
    sections and the example (every ``>>>`` block, with its expected output)."""
    parsed, section, example = Doc(), None, False
    for line in doc.splitlines():
        if line.startswith(">>>"):
            if parsed.example and not example:
                parsed.example.append("")
            example, section = True, None
            parsed.example.append(line)
        elif example and line.strip():
            parsed.example.append(line)
        elif example:  # a blank line ends a block
            example = False
        elif not line[:1].isspace() and line.endswith(":") and line[:-1] in SECTIONS:
            section = line[:-1]
            parsed.sections[section] = []
        elif section is not None and (not line.strip() or line[0].isspace()):
            parsed.sections[section].append(line[4:] if line.startswith("    ") else line.strip())
        else:
            section = None
            parsed.prose.append(line)
    for name, body in parsed.sections.items():
        parsed.sections[name] = _trim(body)
    parsed.prose = _trim(parsed.prose)
    return parsed


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


# ---- signatures -------------------------------------------------------------------


def _parameters(fn: Callable[..., Any], skip_first: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if skip_first else params


def _format(name: str, params: list[inspect.Parameter], returns: str | None) -> str:
    """``name(params) -> returns``, with the annotations as written in the source."""
    parts: list[str] = []
    star = False
    for p in params:
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, star = f"*{p.name}", True
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        elif p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        parts.append(text)
    tail = f" -> {returns}" if returns else ""
    one = f"{name}({', '.join(parts)}){tail}"
    if len(one) <= WIDTH or not parts:
        return one
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){tail}"


def _annotation(a: Any) -> str:
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _returns(fn: Callable[..., Any]) -> str | None:
    a = inspect.signature(fn).return_annotation
    return None if a is inspect.Signature.empty else _annotation(a)


# ---- what is documented -----------------------------------------------------------


@dataclass
class Entry:
    """One documented name: its heading, signature and parsed docstring."""

    heading: str
    signature: str
    doc: Doc
    level: int = 3
    #: where it shares a base class's documentation: that entry's heading
    same_as: str | None = None


def _is_exception(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


def _own_doc(obj: Any) -> str | None:
    return obj.__doc__ if isinstance(obj.__doc__, str) else None


def _methods(cls: type) -> Iterator[tuple[str, Callable[..., Any], type]]:
    """The public methods of ``cls`` (its own and inherited, not ``object``'s),
    with the class in the MRO that defines each."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins":
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen or not inspect.isfunction(value):
                continue
            seen.add(name)
            yield name, value, klass


def entries(module: Any, problems: list[str]) -> list[Entry]:
    """The reference's entries for every name in ``module.__all__``, in order;
    what is missing from a docstring is added to ``problems``."""
    out: list[Entry] = []
    for name in module.__all__:
        obj = getattr(module, name)
        qualified = f"{module.__name__}.{name}"
        if inspect.isclass(obj):
            out.extend(_class_entries(qualified, obj, problems))
        else:
            doc = parse(inspect.cleandoc(_own_doc(obj) or ""))
            params = _parameters(obj, skip_first=False)
            returns = _returns(obj)
            _check_function(qualified, doc, params, returns, problems)
            out.append(Entry(qualified, _format(qualified, params, returns), doc))
    return out


def _class_entries(qualified: str, cls: type, problems: list[str]) -> list[Entry]:
    doc = parse(inspect.cleandoc(_own_doc(cls) or ""))
    if not doc.prose:
        problems.append(f"{qualified}: no docstring")
    if _is_exception(cls):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        return [Entry(qualified, f"class {qualified}({bases})", doc)]
    params = _parameters(cls, skip_first=False) if "__init__" in vars(cls) or _dataclass(cls) else []
    if _dataclass(cls):  # a record xcoll makes: its fields, not its constructor
        documented = [n for n, _ in doc.entries("Attributes")]
        if documented != [p.name for p in params]:
            problems.append(f"{qualified}: Attributes name {documented}, the fields are {params}")
    elif not inspect.isabstract(cls):
        _check_args(qualified, doc, params, problems)
        if "Raises" not in doc.sections and params:
            problems.append(f"{qualified}: no Raises section (for its constructor)")
    signature = _format(f"class {qualified}", params, None) if params else f"class {qualified}"
    found = [Entry(qualified, signature, doc)]
    for name, method, owner in _methods(cls):
        heading = f"{qualified}.{name}"
        mdoc = parse(inspect.cleandoc(_own_doc(method) or ""))
        mparams = _parameters(method, skip_first=True)
        returns = _returns(method)
        signature = _format(name, mparams, returns)
        if owner is not cls and _own_doc(method) is None:
            problems.append(f"{heading}: no docstring")
        shared = _base_documenting(cls, name, method)
        if shared is not None:
            found.append(Entry(heading, signature, Doc(), 4, f"{shared.__name__}.{name}"))
            continue
        _check_function(heading, mdoc, mparams, returns, problems)
        found.append(Entry(heading, signature, mdoc, 4))
    return found


def _dataclass(cls: type) -> bool:
    return hasattr(cls, "__dataclass_fields__")


def _base_documenting(cls: type, name: str, method: Callable[..., Any]) -> type | None:
    """The public base class whose ``name`` documents ``method`` (an override
    without a docstring of its own, with the same signature), if any."""
    if _own_doc(method) is not None and method.__qualname__.split(".")[0] == cls.__name__:
        return None
    for base in cls.__mro__[1:]:
        theirs = vars(base).get(name)
        if base.__name__.startswith("_") or theirs is None or _own_doc(theirs) is None:
            continue
        if theirs is method:
            return base
        if _own_doc(method) is None and inspect.signature(theirs) == inspect.signature(method):
            return base
    return None


def _check_args(
    where: str, doc: Doc, params: list[inspect.Parameter], problems: list[str]
) -> None:
    names = [p.name for p in params]
    documented = [n.lstrip("*") for n, _ in doc.entries("Args")]
    if names and "Args" not in doc.sections:
        problems.append(f"{where}: no Args section (parameters: {', '.join(names)})")
    elif documented != names:
        problems.append(f"{where}: Args name {documented}, the parameters are {names}")


def _check_function(
    where: str,
    doc: Doc,
    params: list[inspect.Parameter],
    returns: str | None,
    problems: list[str],
) -> None:
    if not doc.prose:
        problems.append(f"{where}: no docstring")
        return
    _check_args(where, doc, params, problems)
    if returns != "None" and "Returns" not in doc.sections:
        problems.append(f"{where}: no Returns section")
    if "Raises" not in doc.sections:
        problems.append(f"{where}: no Raises section")


# ---- Markdown ---------------------------------------------------------------------

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc):`~?([^`]+)`")


#: documented name -> its anchor, for the cross-references (set by :func:`generate`)
_LINKS: dict[str, str] = {}


def _link(target: str) -> str:
    """A cross-reference: a link where the reference documents ``target``."""
    for name in (target, *(f"{m}.{target}" for m in MODULES)):
        if name in _LINKS:
            return f"[`{target}`]({_LINKS[name]})"
    return f"`{target}`"


def _md(text: str) -> str:
    """reStructuredText's inline markup as Markdown's."""
    text = _ROLE.sub(lambda m: _link(m.group(1)), text)
    return text.replace("``", "`")


def _prose(lines: list[str]) -> list[str]:
    """Prose lines as Markdown; a paragraph that ends in ``::`` introduces an
    indented literal block, fenced here."""
    out: list[str] = []
    code: list[str] | None = None  # the lines of an open literal block
    for line in lines:
        if code is not None:
            if not line.strip() or line[0].isspace():
                code.append(line[4:] if line.startswith("    ") else line.strip())
                continue
            out += ["```", *_trim(code), "```", ""]
            code = None
        if line.rstrip().endswith("::"):
            out += [_md(line.rstrip()[:-1]), ""]
            code = []
        else:
            out.append(_md(line))
    if code is not None:
        out += ["```", *_trim(code), "```"]
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return "#" + re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def render(entry: Entry) -> list[str]:
    out = [f"{'#' * entry.level} {entry.heading}", "", "```", entry.signature, "```", ""]
    if entry.same_as is not None:
        base = next(m for m in MODULES[::-1] if entry.heading.startswith(m + "."))
        target = f"{base}.{entry.same_as}"
        return [*out, f"As [`{target}`]({anchor(target)}).", ""]
    if entry.doc.prose:
        out += [*_prose(entry.doc.prose), ""]
    for section in SECTIONS:
        if section == "Returns" and section not in entry.doc.sections:
            if entry.signature.endswith("-> None"):
                out += ["**Returns:** None.", ""]
            continue
        if section not in entry.doc.sections:
            continue
        items = entry.doc.entries(section)
        if section == "Returns" or not items:
            out += [f"**{section}:** {_md(entry.doc.text(section))}", ""]
            continue
        out += [f"**{section}:**", ""]
        for name, text in items:
            out.append(f"- `{name}`: {_md(text)}")
        out.append("")
    if entry.doc.example:
        out += ["**Example:**", "", "```pycon", *entry.doc.example, "```", ""]
    return out


def generate() -> str:
    """docs/api.md's text. Raises :class:`DocError` naming every public
    docstring that lacks what the reference needs."""
    sys.path.insert(0, str(ROOT))
    import importlib

    problems: list[str] = []
    by_module = {}
    for name in MODULES:
        module = importlib.import_module(name)
        by_module[name] = (module, entries(module, problems))
    if problems:
        raise DocError("\n".join(problems))
    _LINKS.clear()
    _LINKS.update({e.heading: anchor(e.heading) for _, found in by_module.values() for e in found})
    out = [
        "# API reference",
        "",
        "<!-- Generated from the docstrings by docs/make_api.py: edit those, then run",
        "     `python docs/make_api.py`. tests/test_api_reference.py fails when this",
        "     file is stale or a public name is missing. -->",
        "",
        "Every public name: `xcoll` (`from xcoll import ...`) and `xcoll.testing`",
        "(replica pools for tests). Examples run in a world of one (a plain process);",
        "the same calls run unchanged on XLA replicas and torch.distributed processes",
        "(docs/launchers.md).",
        "",
    ]
    for name, (_, found) in by_module.items():
        links = ", ".join(
            f"[`{e.heading.removeprefix(name + '.')}`]({anchor(e.heading)})"
            for e in found
            if e.level == 3
        )
        out.append(f"- `{name}`: {links}")
    out.append("")
    for name, (module, found) in by_module.items():
        summary = parse(inspect.cleandoc(module.__doc__ or "")).prose
        first = _trim(summary[: summary.index("") if "" in summary else len(summary)])
        out += [f"## {name}", "", *(_md(line) for line in first), ""]
        for entry in found:
            out += render(entry)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    try:
        text = generate()
    except DocError as e:
        print(f"public docstrings lack what the reference needs:\n{e}", file=sys.stderr)
        return 1
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
