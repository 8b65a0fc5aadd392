"""The code's layout holds: no import cycles, and imports point down the layers
(docs/architecture.md draws them). Built from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"errors", "files", "paths", "locks", "lazy", "processes", "splits", "tokenizer", "hub", "moved", "absl_flags"}
# rank of each part: a module may import its own part and any of lower rank
# (parts of one rank import neither each other: preparation and sources share what reads texts, corpora)
RANKS = {"leaf": 0, "stores": 1, "corpora": 2, "packing": 2, "preparation": 3, "sources": 3, "pipeline": 4, "top": 5,
         "bridges": 6}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("forge_grain",):
        for f in sorted((ROOT / package).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def bindings(name: str, path: Path, known: dict, body=None) -> list[tuple[str, str, str | None]]:
    """(bound name, module, attribute or None for a module itself) of each project import in
    `body` (default: the whole module): `from X import m` of a module m binds X.m."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(body if body is not None else ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.asname or a.name, a.name, None) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((a.asname or a.name, full, None) if full in known else (a.asname or a.name, base, a.name))
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The project modules `name` imports."""
    return {module for _, module, _ in bindings(name, path, known) if module in known and module != name}


def part(name: str) -> str:
    bits = name.split(".")
    if len(bits) > 1 and bits[1] == "bridges":
        return "bridges"
    if len(bits) == 1 or bits[1] in ("cli", "demo", "__main__"):
        return "top"
    return "leaf" if bits[1] in LEAVES else bits[1]


def test_there_are_no_import_cycles():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    graph["forge_grain"] = set()  # the package's lazy names resolve on use, not on import
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    known = modules()
    upward = []
    for m, p in known.items():
        for n in imports(m, p, known):
            if n == "forge_grain":
                continue
            a, b = part(m), part(n)
            if a != b and RANKS[b] >= RANKS[a]:
                upward.append(f"{m} ({a}) imports {n} ({b})")
    assert not upward, "imports that climb the layers:\n" + "\n".join(sorted(upward))


MODULE_LINES, CLASS_LINES = 600, 300  # what one reads in a sitting (docs/architecture.md)


def test_modules_and_classes_stay_small():
    """A module holds one job and a class one owner: past these sizes, split by what they hold."""
    large = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            large.append(f"module {name}: {text.count(chr(10))} lines (at most {MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                large.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines "
                             f"(at most {CLASS_LINES})")
    assert not large, "too large to read in one sitting:\n" + "\n".join(large)


def test_following_the_config_climbs_back_up_at_most_a_few_times():
    """Read from `Pipeline.__init__` along the config, each layer's part of the work is read in
    a few runs, not in and out of a layer below (tests/call_walk.py says how it is counted)."""
    from call_walk import MAX_CLIMBS, climbs, walk

    order = walk()
    reached = {module for module, _ in order}
    assert {"forge_grain.sources.factory", "forge_grain.corpora.streams", "forge_grain.packing.plans",
            "forge_grain.pipeline.mixture"} <= reached, "the walk no longer follows the config into the sources"
    up = climbs(order)
    assert len(up) <= MAX_CLIMBS, "the walk climbs back up:\n" + "\n".join(f"{a} -> {b}" for a, b in up)
