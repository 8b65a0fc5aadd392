"""The code's layout holds: no import cycles, and imports point down the layers
(docs/architecture.md draws them). Built from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"errors", "paths", "locks", "processes", "splits", "tokenizer", "hub", "moved", "absl_flags"}
# rank of each part: a module may import its own part and any of lower rank
RANKS = {"leaf": 0, "stores": 1, "packing": 2, "preparation": 2, "sources": 3, "pipeline": 4, "top": 5, "bridges": 6}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("forge_grain", "bridges"):
        for f in sorted((ROOT / package).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The project modules `name` imports (a `from X import m` of a module m counts as X.m)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def part(name: str) -> str:
    bits = name.split(".")
    if bits[0] == "bridges":
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
