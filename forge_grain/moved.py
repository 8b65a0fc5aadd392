"""Modules that moved when the package was laid out by kind, still importable by their old
names for one release, with a `DeprecationWarning` naming the new one.

The bridges were a top-level package, `bridges`, beside `forge_grain`; they are
`forge_grain.bridges` now, so the wheel installs one top-level name. `import bridges.torch`
still works (and warns) in any process: the wheel's `forge_grain_old_names.pth` asks
`find_old_name` for a module named `bridges` that nothing else on the path provides (a
project's own `bridges/`, or PyPI's unrelated `bridges`, comes first and is left alone).

`import forge_grain.varlen` (now `forge_grain.packing.varlen`) gives the module at its new
place; so does every other old top-level name below. Four old modules share their name with
a package now (`forge_grain.pipeline`, `.packing`, `.preparation`, `.sources`): what they
held is still found there by attribute (`from forge_grain.pipeline import Pipeline`), also
with a warning. The public names are those `forge_grain` itself exports, which never moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

REMOVED_IN = "0.2"
MOVED = {  # old module -> new module
    "forge_grain.beam_prepare": "forge_grain.preparation.beam",
    "forge_grain.buffers": "forge_grain.packing.buffers",
    "forge_grain.checkpoint": "forge_grain.pipeline.checkpoint",
    "forge_grain.chunked": "forge_grain.packing.chunked",
    "forge_grain.config": "forge_grain.pipeline.config",
    "forge_grain.deferred": "forge_grain.sources.deferred",
    "forge_grain.foreign": "forge_grain.stores.raw",
    "forge_grain.hf": "forge_grain.preparation.hf_cache",
    "forge_grain.history": "forge_grain.pipeline.history",
    "forge_grain.identify": "forge_grain.stores.identify",
    "forge_grain.kempnerforge": "forge_grain.pipeline.kempnerforge",
    "forge_grain.kernels": "forge_grain.packing.kernels",
    "forge_grain.manifest": "forge_grain.stores.manifest",
    "forge_grain.mapping": "forge_grain.stores.mapping",
    "forge_grain.mixture": "forge_grain.pipeline.mixture",
    "forge_grain.packed": "forge_grain.packing.packed",
    "forge_grain.streaming": "forge_grain.sources.streaming",
    "forge_grain.summary": "forge_grain.packing.summary",
    "forge_grain.text_streams": "forge_grain.corpora.streams",
    "forge_grain.texts": "forge_grain.corpora.loading",
    "forge_grain.tokenize_pool": "forge_grain.sources.tokenize_pool",
    "forge_grain.varlen": "forge_grain.packing.varlen",
    "forge_grain.writer": "forge_grain.stores.writer",
    # reading texts, below both preparation and sources (0.1.x)
    "forge_grain.preparation.texts": "forge_grain.corpora.loading",
    "forge_grain.preparation.tokenize_pool": "forge_grain.sources.tokenize_pool",
    "forge_grain.sources.hf": "forge_grain.preparation.hf_cache",
    "forge_grain.sources.text_streams": "forge_grain.corpora.streams",
    # the bridges, a top-level package until 0.1.x
    "bridges": "forge_grain.bridges",
    **{f"bridges.{m}": f"forge_grain.bridges.{m}" for m in (
        "jax", "kempnerforge", "olmo", "titan_batches", "torch", "torch_channel", "torch_slots", "torch_varlen",
        "torchtitan")},
}
# old modules some of whose names were split out of the module they moved to -> where those are
# now (a module, or "module:object" for names that became an object's attributes)
ALSO = {
    "forge_grain.kempnerforge": ["forge_grain.pipeline.config:DataConfig"],
    "forge_grain.kernels": ["forge_grain.packing.kernels.cache"],
    "forge_grain.streaming": ["forge_grain.sources.stream_cursors"],
    "forge_grain.texts": ["forge_grain.hub", "forge_grain.corpora.files", "forge_grain.corpora.rows"],
    "forge_grain.preparation.texts": ["forge_grain.corpora.files", "forge_grain.corpora.rows"],
    "forge_grain.hf": ["forge_grain.corpora.cache_keys"],
    "forge_grain.sources.hf": ["forge_grain.corpora.cache_keys"],
}
# old modules whose name is a package now -> the module that holds what they held
BECAME_PACKAGES = {
    "forge_grain.packing": "forge_grain.packing.plans",
    "forge_grain.pipeline": "forge_grain.pipeline.pipeline",
    "forge_grain.preparation": "forge_grain.preparation.local",
    "forge_grain.sources": "forge_grain.sources.factory",
}


def _warn(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the line that imported the old name (not to the
    import machinery, where Python's default filters would hide it)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: _warn's caller
    while frame is not None and (frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename
                                 or frame.f_code.co_name == "__getattr__"):
        if "_bootstrap" not in frame.f_code.co_filename:  # (warnings skips importlib's bootstrap frames itself)
            level += 1
        frame = frame.f_back
    warnings.warn(f"{old} moved to {new}; the old name goes in forge-grain {REMOVED_IN}", DeprecationWarning,
                  stacklevel=level)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name; the module made for it forwards every attribute to the new
    module (the new module itself is left as it is)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # an ordinary module, filled in below

    def exec_module(self, module):
        new = MOVED[module.__name__]
        _warn(module.__name__, new)
        target = importlib.import_module(new)
        others = [_holder(where) for where in ALSO.get(module.__name__, [])]

        def attribute(name):
            for holder in (target, *others):
                if hasattr(holder, name):
                    return getattr(holder, name)
            raise AttributeError(f"module {module.__name__!r} (moved to {new}) has no attribute {name!r}")

        module.__doc__ = f"Deprecated: moved to {new}."
        if hasattr(target, "__path__"):
            module.__path__ = []  # a package: its old submodule names are found here too
        module.__getattr__ = attribute
        module.__dir__ = lambda: dir(target)
        module.__all__ = list(getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")]))


def _holder(where: str):
    """The module (or "module:object") that `ALSO` names."""
    module, _, name = where.partition(":")
    held = importlib.import_module(module)
    return getattr(held, name) if name else held


def find_old_name(fullname: str):
    """The spec of an old module name, or None (for the `.pth` finder: a process that has
    not imported forge_grain yet)."""
    return _Alias().find_spec(fullname)


def install() -> None:
    """Let the old names import (once per process)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())


def package_attribute(package: str, name: str):
    """`name` of the module that the old `package` module became (for a package's
    `__getattr__`), with a warning; AttributeError when that module has no such name."""
    new = BECAME_PACKAGES[package]
    if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(name)  # a submodule (`from forge_grain.pipeline import history`): imported as such
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    return getattr(module, name)
