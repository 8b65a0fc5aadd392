"""How often following the config through the code climbs back up the layers.

A static walk of the call graph from `Pipeline.__init__`, following `config`: a call is
followed when one of its arguments mentions a name that holds (part of) the config, and in
the callee the parameters those arguments bind hold it in turn; names assigned or looped
from such a name hold it too. Calls resolve through the module's own functions and classes
(a class call is its `__init__`), names imported from project modules, `module.f`,
`Class.f`, and `self.f` within a class. Each function is visited once, depth first, in the
order its calls appear.

A reader following the walk reads the layers (`test_layout.RANKS`) in that order; a
*climb* is a step from one layer to a higher one: the reader went down into another layer
and came back up to read on. The leaves (errors, paths, locks, ...) are helpers of every
layer and no layer of their own. Few climbs means each layer's part of the work is read in
one go. `python tests/call_walk.py` prints the runs in walk order and the count;
`tests/test_layout.py` keeps it at most `MAX_CLIMBS`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_layout import RANKS, bindings, modules, part  # noqa: E402

MAX_CLIMBS = 8
START = ("forge_grain.pipeline.pipeline", "Pipeline.__init__")


class Code:
    """Every project function by (module, qualified name), and what each module's names are."""

    def __init__(self):
        self.paths = modules()
        self.functions, self.classes, self.trees = {}, {}, {}
        for m, p in self.paths.items():
            tree = ast.parse(p.read_text())
            self.trees[m] = tree
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions[(m, node.name)] = node
                elif isinstance(node, ast.ClassDef):
                    self.classes[(m, node.name)] = node
                    for f in node.body:
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self.functions[(m, f"{node.name}.{f.name}")] = f

    def names(self, module: str, body) -> dict:
        """Names bound by the imports in `body` (a module or a function): name -> (module, attr
        or None for a module)."""
        return {bound: (target, attr) for bound, target, attr in bindings(module, self.paths[module], self.paths, body)}

    def resolve(self, module: str, cls: str | None, call: ast.Call, names: dict):
        """The project function a call runs, or None."""
        f = call.func
        if isinstance(f, ast.Name):
            target = names.get(f.id, (module, f.id))
            return self._function(*target) if target[1] else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            base = f.value.id
            if base == "self" and cls:
                return self._function(module, f"{cls}.{f.attr}")
            target = names.get(base, (module, base))
            if target[1] is None:  # a module
                return self._function(target[0], f.attr)
            return self._function(target[0], f"{target[1]}.{f.attr}")  # Class.method
        return None

    def _function(self, module: str, name: str):
        if (module, name) in self.functions:
            return module, name
        if (module, name) in self.classes:
            return (module, f"{name}.__init__") if (module, f"{name}.__init__") in self.functions else None
        return None


def _mentions(node, held: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in held or
               isinstance(n, ast.Attribute) and ast.unparse(n) in held for n in ast.walk(node))


def _bound(target) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(target) if isinstance(n, (ast.Name, ast.Attribute))]


def _params(fn, call: ast.Call, held: set[str], method: bool) -> set[str]:
    """The callee's parameters that the call's config-holding arguments bind."""
    args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if method and args and args[0] in ("self", "cls"):
        args = args[1:]
    out = {args[i] for i, a in enumerate(call.args) if i < len(args) and _mentions(a, held)}
    out |= {k.arg for k in call.keywords if k.arg and _mentions(k.value, held)}
    return out


def walk(code: Code | None = None) -> list[tuple[str, str]]:
    """The functions the config reaches, in depth-first order."""
    code = code or Code()
    seen, order = set(), []

    def visit(key, held):
        if key in seen:
            return
        seen.add(key)
        order.append(key)
        module, name = key
        fn = code.functions[key]
        cls = name.split(".")[0] if "." in name else None
        names = {**code.names(module, code.trees[module]), **code.names(module, fn)}
        held = set(held)
        for node in ast.walk(fn):  # names that hold the config (assigned, looped, bound)
            if isinstance(node, ast.Assign) and _mentions(node.value, held):
                held |= {b for t in node.targets for b in _bound(t)}
            elif isinstance(node, (ast.For, ast.comprehension)) and _mentions(node.iter, held):
                held |= set(_bound(node.target))
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        for call in calls:
            callee = code.resolve(module, cls, call, names)
            if callee is None or callee in seen:
                continue
            params = _params(code.functions[callee], call, held, "." in callee[1])
            if params:
                visit(callee, params)

    visit(START, {"config"})
    return order


def layers_in_order(order) -> list[tuple[str, str]]:
    """(layer, module) of each run of the walk in one layer; the leaves (errors, paths,
    locks, ...: helpers every layer calls) are no layer to climb from."""
    out = []
    for module, _ in order:
        layer = part(module)
        if layer != "leaf" and (not out or out[-1][0] != layer):
            out.append((layer, module))
    return out


def climbs(order) -> list[tuple[str, str]]:
    """The steps from one layer's module to a module of a higher layer."""
    runs = layers_in_order(order)
    return [(a[1], b[1]) for a, b in zip(runs, runs[1:]) if RANKS[b[0]] > RANKS[a[0]]]


if __name__ == "__main__":
    order = walk()
    runs = layers_in_order(order)
    for i, (layer, module) in enumerate(runs):
        up = i and RANKS[layer] > RANKS[runs[i - 1][0]]
        print(f"{RANKS[layer]} {module}{'  ^ climbs back up' if up else ''}")
    print(f"{len(order)} functions, {len(runs)} runs in one layer, {len(climbs(order))} climbs (at most {MAX_CLIMBS})")
