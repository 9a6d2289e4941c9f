"""Every counter fedring bumps has a row on docs/operations/counters.md, and every row
names a counter the code still bumps, in the modules the row says.

The names come from the source, not from a run: an AST scan of ``fedring/**/*.py``
for ``<...>.counters.add(NAME)`` / ``counters.add(NAME)`` (the receiver is what makes
it a counter: every `fedring.counters.Counters` the package bumps is held under the
name ``counters``; ``set.add`` and the part joiners' ``add`` have other receivers).
``NAME`` is resolved when it is

- a string literal;
- an f-string whose placeholders are listed in `FAMILIES` (expanded to every value,
  as the page expands them: the frame reasons from `FrameReason`, the pipeline phases);
- a module constant, here or imported (``ATTACK_COUNTER``);
- a parameter of the function around the call (``refused(counters, counter, why)``):
  then the string literals passed for it at the function's call sites are the names,
  each under the module of its call site (where the event is decided).

Anything else fails the test with the file and line, so a counter the scan cannot
read is never silently left out.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fedring.pipeline.stage import ACT, GRAD
from fedring.wire.errors import FrameReason

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedring"
PAGE = ROOT / "docs" / "operations" / "counters.md"

# (module, placeholder source) -> the values the placeholder takes. A new f-string
# counter fails `test_every_counter_name_resolves` until its family is added here.
FAMILIES: dict[tuple[str, str], tuple[str, ...]] = {
    ("edge_agent/daemon.py", "exc.reason.value"): tuple(r.value for r in FrameReason),
    ("collective/channel.py", "exc.reason.value"): tuple(r.value for r in FrameReason),
    ("wire/control.py", "exc.reason.value"): tuple(r.value for r in FrameReason),
    ("pipeline/stage.py", "phase"): (ACT, GRAD),  # `Stage._send`'s callers pass ACT or GRAD
}

Names = dict[str, set[str]]  # counter name -> modules (relative to fedring/) that bump it


@dataclass(frozen=True)
class Helper:
    """A function that bumps its parameter `param` (position `index` at a call site)."""

    module: str
    name: str
    param: str
    index: int


@dataclass
class Scan:
    names: Names
    unresolved: list[str]  # "module:line: why"


def _module(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _is_counters(node: ast.expr) -> bool:
    """`counters` or `<anything>.counters`: the receivers the package bumps counters on."""
    if isinstance(node, ast.Name):
        return node.id == "counters"
    return isinstance(node, ast.Attribute) and node.attr == "counters"


def _counter_adds(tree: ast.AST) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every ``counters.add(...)`` call with the chain of nodes around it (outermost first)."""
    found: list[tuple[ast.Call, list[ast.AST]]] = []

    def walk(node: ast.AST, chain: list[ast.AST]) -> None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add"
            and _is_counters(node.func.value)
        ):
            found.append((node, chain))
        for child in ast.iter_child_nodes(node):
            walk(child, [*chain, node])

    walk(tree, [])
    return found


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments."""
    out: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and isinstance(stmt.value.value, str):
                    out[target.id] = stmt.value.value
    return out


def _imported_constant(tree: ast.Module, name: str, trees: dict[str, ast.Module]) -> str | None:
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("fedring"):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = stmt.module.removeprefix("fedring").strip(".").replace(".", "/")
                    other = trees.get(f"{source}.py")
                    return _constants(other).get(alias.name) if other else None
    return None


def _enclosing_function(chain: list[ast.AST]) -> tuple[ast.FunctionDef, bool] | None:
    """The innermost function around a call, and whether it is a method of a class."""
    for i in range(len(chain) - 1, -1, -1):
        node = chain[i]
        if isinstance(node, ast.FunctionDef):
            return node, i > 0 and isinstance(chain[i - 1], ast.ClassDef)
    return None


def _expand(module: str, node: ast.JoinedStr, where: str, scan: Scan) -> None:
    names = [""]
    for part in node.values:
        if isinstance(part, ast.Constant):
            names = [n + str(part.value) for n in names]
            continue
        assert isinstance(part, ast.FormattedValue)
        source = ast.unparse(part.value)
        values = FAMILIES.get((module, source))
        if values is None:
            scan.unresolved.append(f"{where}: f-string placeholder {{{source}}} not in FAMILIES")
            return
        names = [n + v for n in names for v in values]
    for name in names:
        scan.names[name].add(module)


def _call_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _helper_names(helper: Helper, trees: dict[str, ast.Module], scan: Scan) -> None:
    """The string literals passed for `helper.param` at the helper's call sites: only
    in its own module for a private (``_name``) helper, anywhere for a public one.
    A call with no string there (another class's method of the same name, such as
    the edge lab's ``dropped()``) names nothing."""
    found = False
    for module, tree in trees.items():
        if helper.name.startswith("_") and module != helper.module:
            continue
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or _call_name(call) != helper.name:
                continue
            args = [k.value for k in call.keywords if k.arg == helper.param]
            if len(call.args) > helper.index:
                args.append(call.args[helper.index])
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    scan.names[arg.value].add(module)  # where the event is decided
                    found = True
    if not found:
        scan.unresolved.append(
            f"{helper.module}: {helper.name}() bumps its {helper.param!r} but no call passes a "
            "string literal for it"
        )


def scan_package() -> Scan:
    trees = {_module(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}
    scan = Scan(defaultdict(set), [])
    helpers: set[Helper] = set()
    for module, tree in trees.items():
        for call, chain in _counter_adds(tree):
            where = f"{module}:{call.lineno}"
            arg = call.args[0] if call.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                scan.names[arg.value].add(module)
            elif isinstance(arg, ast.JoinedStr):
                _expand(module, arg, where, scan)
            elif isinstance(arg, ast.Name):
                enclosing = _enclosing_function(chain)
                params = [a.arg for a in enclosing[0].args.args] if enclosing else []
                value = _constants(tree).get(arg.id) or _imported_constant(tree, arg.id, trees)
                if enclosing and arg.id in params:
                    index = params.index(arg.id) - (1 if enclosing[1] else 0)
                    helpers.add(Helper(module, enclosing[0].name, arg.id, index))
                elif value is not None:
                    scan.names[value].add(module)
                else:
                    scan.unresolved.append(f"{where}: counter name {arg.id!r} not resolved")
            else:
                shown = ast.unparse(arg) if arg else "nothing"
                scan.unresolved.append(f"{where}: counter name {shown} not resolved")
    for helper in sorted(helpers, key=lambda h: (h.module, h.name)):
        _helper_names(helper, trees, scan)
    return scan


_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*)\|")


def documented() -> Names:
    """The page's table rows: the first cell a `counter`, the second its modules."""
    out: Names = defaultdict(set)
    for line in PAGE.read_text().splitlines():
        row = _ROW.match(line)
        if row:
            out[row.group(1)] |= set(re.findall(r"`([\w/]+\.py)`", row.group(2)))
    return out


SCAN = scan_package()


def _pairs(names: Names) -> set[tuple[str, str]]:
    return {(name, module) for name, modules in names.items() for module in modules}


def test_every_counter_name_resolves() -> None:
    assert SCAN.unresolved == []
    assert len(SCAN.names) > 50  # the scan finds the package's counters at all


def test_every_counter_is_documented() -> None:
    missing = sorted(set(SCAN.names) - set(documented()))
    assert missing == [], f"counters bumped in fedring/ but not on {PAGE.name}: {missing}"


def test_no_stale_rows() -> None:
    stale = sorted(set(documented()) - set(SCAN.names))
    assert stale == [], f"rows on {PAGE.name} for counters nothing bumps: {stale}"


def test_rows_name_the_modules_that_bump_them() -> None:
    code, page = _pairs(SCAN.names), _pairs(documented())
    assert sorted(code - page) == [], "a counter's row does not name a module that bumps it"
    assert sorted(page - code) == [], "a counter's row names a module that does not bump it"


def test_string_adds_are_counters_or_local_sets() -> None:
    """The receiver rule is what keeps sets out, so it must not hide counters: a
    ``.add("text")`` (or f-string) on a receiver other than ``counters`` is allowed only
    on a name the same function made a set (``names = {...}`` / ``set()``). A
    `Counters` held under another name fails here until it is named ``counters``."""
    odd = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            sets = {
                t.id
                for a in ast.walk(fn)
                if isinstance(a, ast.Assign)
                and (
                    isinstance(a.value, ast.Set | ast.SetComp)
                    or (isinstance(a.value, ast.Call) and ast.unparse(a.value.func) == "set")
                )
                for t in a.targets
                if isinstance(t, ast.Name)
            }
            for call in ast.walk(fn):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "add"
                    and call.args
                    and isinstance(call.args[0], ast.Constant | ast.JoinedStr)
                    and isinstance(getattr(call.args[0], "value", ""), str)
                    and not _is_counters(call.func.value)
                    and ast.unparse(call.func.value) not in sets
                ):
                    odd.append(f"{_module(path)}:{call.lineno}: {ast.unparse(call)}")
    assert odd == []
