#!/usr/bin/env python
"""The rooms of ``megatron_bitpipe``, their import graph, levels, circles and upward imports.

    python scripts/import_layers.py            # the figures and every circle and upward import
    python scripts/import_layers.py --edges    # also every arrow between rooms

A *room* is a top-level module or subpackage of the package (``model``, ``run_config``, ...;
the package's own ``__init__.py`` is the room ``__init__``). Every import statement of every
module counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:``. An import names one module: ``from a.b import c`` names ``a.b.c`` when
that is a module (or a name that ``a.b``'s ``__init__`` loads lazily from its submodule ``c``
through a ``{name: submodule}`` table and a module ``__getattr__``), else ``a.b``; the parent
packages' ``__init__`` files, which Python runs too, are not counted.

* A *circle* is a set of modules that import each other (a strongly connected component of
  the module graph with more than one module); the shortest loop through it is shown.
* An *arrow* joins two rooms when a module of one imports a module of the other. The rooms are
  put on levels: an order of the rooms is chosen that leaves the fewest arrows pointing from a
  lower room to a higher one (ties: the fewest import statements behind them), those arrows
  are the *upward imports*, and every other arrow points down; a room's level is 0 if it
  imports no other room along a downward arrow, else one more than the highest level it
  imports that way.

:func:`analyse` returns an :class:`ImportLayers`; the test suite asserts its figures.
"""

from __future__ import annotations

import argparse
import ast
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

PACKAGE = "megatron_bitpipe"
ROOT = Path(__file__).resolve().parents[1]
#: largest strongly connected set of rooms ordered exactly (2^n orders of subsets); a larger
#: one is refused rather than ordered by a heuristic
MAX_EXACT_ROOMS = 18


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``source`` (module) imports ``target`` (module)."""

    source: str
    target: str
    path: str  #: the importing file, relative to the repository root
    line: int
    kind: str  #: "module", "function" (inside a def) or "type-checking" (under ``if TYPE_CHECKING``)

    def __str__(self) -> str:
        where = "" if self.kind == "module" else f" ({self.kind})"
        return f"{self.path}:{self.line} -> {self.target}{where}"


@dataclass
class ImportLayers:
    """The figures of one reading of the package."""

    rooms: List[str]
    imports: List[Import]
    #: room -> level (0: imports no room along a downward arrow)
    levels: Dict[str, int]
    #: (lower room, higher room) -> the import statements behind that upward arrow
    upward: Dict[Tuple[str, str], List[Import]]
    #: each circle: the loop of modules (first module repeated at the end) and its imports
    circles: List[List[Import]] = field(default_factory=list)

    @property
    def num_levels(self) -> int:
        return 1 + max(self.levels.values()) if self.levels else 0

    def arrows(self) -> Dict[Tuple[str, str], List[Import]]:
        """(importing room, imported room) -> the import statements behind the arrow."""
        out: Dict[Tuple[str, str], List[Import]] = {}
        for imp in self.imports:
            a, b = room_of(imp.source), room_of(imp.target)
            if a != b:
                out.setdefault((a, b), []).append(imp)
        return out

    def report(self, edges: bool = False) -> str:
        up, circles = len(self.upward), len(self.circles)
        lines = [
            f"{len(self.rooms)} rooms on {self.num_levels} levels, {up} upward import{'' if up == 1 else 's'}, "
            f"{circles} circle{'' if circles == 1 else 's'}"
        ]
        for level in range(self.num_levels - 1, -1, -1):
            lines.append(f"  level {level}: " + ", ".join(r for r in self.rooms if self.levels[r] == level))
        for (low, high), imps in sorted(self.upward.items()):
            lines.append(f"upward: {low} (level {self.levels[low]}) -> {high} (level {self.levels[high]})")
            lines.extend(f"    {imp}" for imp in imps)
        for loop in self.circles:
            lines.append("circle: " + " -> ".join([loop[0].source] + [imp.target for imp in loop]))
            lines.extend(f"    {imp}" for imp in loop)
        if edges:
            for (a, b), imps in sorted(self.arrows().items()):
                up = " (upward)" if (a, b) in self.upward else ""
                lines.append(f"arrow: {a} -> {b}{up}: {len(imps)} imports")
        return "\n".join(lines)


def room_of(module: str) -> str:
    """The room of a dotted module name of the package (``__init__`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_names(package_dir: Path) -> Dict[str, Path]:
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _lazy_names(tree: ast.Module, package: str, modules: Set[str]) -> Dict[str, str]:
    """name -> submodule for a package ``__init__`` that loads names on first use (a module
    ``__getattr__`` and a dict literal mapping names to submodule names)."""
    if not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body):
        return {}
    lazy = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            for key, sub in zip(value.keys, value.values):
                if isinstance(key, ast.Constant) and isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    if f"{package}.{sub.value}" in modules:
                        lazy[key.value] = f"{package}.{sub.value}"
    return lazy


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module):
    """(node, kind) for every import statement of ``tree``."""

    def visit(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "type-checking" if kind == "type-checking" else "function"
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from visit_body(child.body, "type-checking")
                yield from visit_body(child.orelse, kind)
                continue
            else:
                inner = kind
            yield from visit(child, inner)

    def visit_body(body, kind):
        holder = ast.Module(body=body, type_ignores=[])
        yield from visit(holder, kind)

    yield from visit(tree, "module")


def read_imports(package_dir: Path) -> Tuple[Dict[str, Path], List[Import]]:
    """The package's modules (dotted name -> file) and every import of one by another."""
    names = _module_names(package_dir)
    modules = set(names)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in names.items()}
    lazy = {name: _lazy_names(tree, name, modules) for name, tree in trees.items() if names[name].name == "__init__.py"}
    imports = []
    for name, tree in trees.items():
        path = names[name]
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rsplit(".", 1)[0]
        rel = str(path.relative_to(package_dir.parent))
        for node, kind in _statements(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # "import a.b.c" names a.b.c (the longest prefix that is a module)
                    parts = alias.name.split(".")
                    for n in range(len(parts), 0, -1):
                        if ".".join(parts[:n]) in modules:
                            targets.append(".".join(parts[:n]))
                            break
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                if origin not in modules:
                    continue
                for alias in node.names:
                    sub = f"{origin}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif alias.name in lazy.get(origin, {}):
                        targets.append(lazy[origin][alias.name])
                    else:
                        targets.append(origin)
            for target in dict.fromkeys(targets):
                if target != name:
                    imports.append(Import(name, target, rel, node.lineno, kind))
    return names, imports


def _components(nodes: Sequence[str], succ: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def _shortest_loop(start: str, comp: Set[str], by_pair: Dict[Tuple[str, str], Import]) -> List[Import]:
    """The shortest loop of imports from ``start`` back to it inside ``comp``."""
    succ: Dict[str, List[str]] = {}
    for a, b in by_pair:
        if a in comp and b in comp:
            succ.setdefault(a, []).append(b)
    parent: Dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(succ.get(v, ())):
            if w == start:
                loop = [by_pair[(v, w)]]
                while v != start:
                    loop.append(by_pair[(parent[v], v)])
                    v = parent[v]
                return loop[::-1]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no loop")


def _order(rooms: List[str], weight: Dict[Tuple[str, str], int]) -> List[str]:
    """An order of ``rooms`` (bottom first) with the fewest arrows from an earlier room to a
    later one, then the fewest import statements behind them (exact, over subsets)."""
    n = len(rooms)
    if n > MAX_EXACT_ROOMS:
        raise ValueError(f"{n} rooms import each other ({', '.join(rooms)}): too many to order exactly")
    best: Dict[int, Tuple[int, int]] = {0: (0, 0)}
    choice: Dict[int, int] = {}
    for size in range(n):
        for members in itertools.combinations(range(n), size):
            mask = sum(1 << i for i in members)
            cost = best[mask]
            for v in range(n):
                if mask >> v & 1:
                    continue
                # v placed above every room of mask: arrows from mask's rooms to v point up
                up = [weight[(rooms[u], rooms[v])] for u in members if (rooms[u], rooms[v]) in weight]
                new = (cost[0] + len(up), cost[1] + sum(up))
                nxt = mask | 1 << v
                if nxt not in best or new < best[nxt]:
                    best[nxt], choice[nxt] = new, v
    order: List[str] = []
    mask = (1 << n) - 1
    while mask:
        v = choice[mask]
        order.append(rooms[v])
        mask &= ~(1 << v)
    return order[::-1]


def analyse(package_dir: Optional[Path] = None) -> ImportLayers:
    """Read the package under ``package_dir`` (default: this checkout's) and compute its layers."""
    package_dir = package_dir or ROOT / PACKAGE
    names, imports = read_imports(package_dir)
    rooms = sorted({room_of(name) for name in names})

    by_pair: Dict[Tuple[str, str], Import] = {}
    for imp in imports:
        by_pair.setdefault((imp.source, imp.target), imp)
    succ: Dict[str, Set[str]] = {}
    for a, b in by_pair:
        succ.setdefault(a, set()).add(b)
    circles = [
        _shortest_loop(comp[0], set(comp), by_pair) for comp in _components(list(names), succ) if len(comp) > 1
    ]

    weight: Dict[Tuple[str, str], int] = {}
    for imp in imports:
        a, b = room_of(imp.source), room_of(imp.target)
        if a != b:
            weight[(a, b)] = weight.get((a, b), 0) + 1
    room_succ: Dict[str, Set[str]] = {}
    for a, b in weight:
        room_succ.setdefault(a, set()).add(b)
    upward_pairs: Set[Tuple[str, str]] = set()
    for comp in _components(rooms, room_succ):
        if len(comp) == 1:
            continue
        position = {room: i for i, room in enumerate(_order(comp, weight))}
        upward_pairs |= {(a, b) for a, b in weight if a in position and b in position and position[a] < position[b]}

    levels: Dict[str, int] = {}

    def level(room: str) -> int:
        if room not in levels:
            below = [level(b) for a, b in weight if a == room and (a, b) not in upward_pairs]
            levels[room] = 1 + max(below) if below else 0
        return levels[room]

    for room in rooms:
        level(room)
    upward = {
        pair: [imp for imp in imports if (room_of(imp.source), room_of(imp.target)) == pair]
        for pair in sorted(upward_pairs)
    }
    return ImportLayers(rooms=rooms, imports=imports, levels=levels, upward=upward, circles=circles)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="also list every arrow between rooms")
    args = parser.parse_args(argv)
    print(analyse().report(edges=args.edges))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
