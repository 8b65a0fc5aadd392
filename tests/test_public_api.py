"""The public API is what the README and docs name: every import they show works without a
warning, and every module the layout by kind moved still imports by its old name for one
release, with a DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from forge_grain.moved import BECAME_PACKAGES, MOVED

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = ("README.md", "docs/**/*.md", "examples/*.py")
# frameworks a documented import needs that the test environment does not hold (torchtitan's
# pins conflict with it: tests/test_torchtitan.py runs it in an environment of its own)
ELSEWHERE = {"torchtitan"}


def documented_imports() -> list[str]:
    """Every `from forge_grain... import ...` and `import forge_grain...` line the README, the
    docs and the examples show (one line each)."""
    found = set()
    for pattern in DOCUMENTED:
        for f in ROOT.glob(pattern):
            for m in re.finditer(r"^\s*(from forge_grain[\w.]* import [\w, ]+|import forge_grain[\w.]*)",
                                 f.read_text(), re.M):
                found.add(m.group(1).strip().rstrip(","))
    return sorted(found)


@pytest.mark.parametrize("line", documented_imports())
def test_every_documented_import_works_without_a_warning(line):
    sys.path.insert(0, str(ROOT))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            exec(line, {})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ELSEWHERE:
            raise
        pytest.skip(f"{line}: needs {e.name}, tested in its own environment")
    finally:
        sys.path.remove(str(ROOT))


def test_the_documented_imports_were_found():
    lines = documented_imports()
    assert any("forge_grain.packing.varlen" in x or "from forge_grain import" in x for x in lines) and len(lines) > 5


# names the old modules held that were split out of the module each moved to (as of the move)
SPLIT_OUT = [("forge_grain.streaming", n) for n in ("StreamCursor", "Dealer", "StreamRows", "StreamingRows",
                                                    "StreamingRowsIterator", "AHEAD")] + [
    ("forge_grain.kempnerforge", "from_kempnerforge"), ("forge_grain.kernels", "CACHE"), ("forge_grain.texts", "HUB_HOST")]


def test_names_split_out_after_a_move_still_import_by_the_old_module():
    """`from forge_grain.streaming import StreamCursor` (and the like) kept working: the alias
    finds names in the modules they were split into later."""
    code = "import warnings; warnings.simplefilter('ignore')\n" + "".join(
        f"from {old} import {name}\n" for old, name in SPLIT_OUT)
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_by_its_old_name_with_a_warning(old):
    # (an old bridges name in a process without forge_grain imported is the wheel's .pth's:
    # test_the_wheel_installs_one_package_and_the_old_bridges_name_still_imports)
    prelude = "import forge_grain\n" if old.split(".")[0] == "bridges" else ""
    if old.endswith("torchtitan"):
        pytest.importorskip("torchtitan", reason="torchtitan runs in its own environment (tests/test_torchtitan.py)")
    code = (f"{prelude}import warnings, importlib\nwarnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as w:\n"
            f"    m = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({MOVED[old]!r})\n"
            f"names = [n for n in vars(new) if not n.startswith('_')]\n"
            f"assert (names or hasattr(new, '__path__')) and all(getattr(m, n) is getattr(new, n) for n in names)\n"
            f"assert any(issubclass(x.category, DeprecationWarning) and {MOVED[old]!r} in str(x.message)\n"
            f"           and x.filename == '<string>' for x in w), [(x.filename, str(x.message)) for x in w]\n"
            f"assert new.__name__ == {MOVED[old]!r} and new.__spec__.name == {MOVED[old]!r}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("package", sorted(BECAME_PACKAGES))
def test_an_old_module_that_is_a_package_now_still_gives_its_names(package):
    new = importlib.import_module(BECAME_PACKAGES[package])
    name = next(n for n in vars(new) if not n.startswith("_") and callable(getattr(new, n))
                and getattr(getattr(new, n), "__module__", None) == new.__name__)
    with pytest.warns(DeprecationWarning, match=rf"{package}\.{name} moved to {BECAME_PACKAGES[package]}\.{name}"):
        got = getattr(importlib.import_module(package), name)
    assert got is getattr(new, name)
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(package), "no_such_name")


OLD_BRIDGES = """
import site, sys, warnings
site.addsitedir(sys.argv[1])  # site-packages as pip fills it: the wheel's .pth runs
sys.path.insert(0, sys.path.pop(sys.path.index(sys.argv[1])))
assert "forge_grain" not in sys.modules
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as w:
    from bridges.torch import GrainIterableDataset
    import bridges.jax
import forge_grain.bridges.torch
import forge_grain.bridges.jax
assert forge_grain.__file__.startswith(sys.argv[1]), forge_grain.__file__
assert GrainIterableDataset is forge_grain.bridges.torch.GrainIterableDataset
assert bridges.jax.JaxIterator is forge_grain.bridges.jax.JaxIterator
said = [(x.filename, str(x.message)) for x in w if issubclass(x.category, DeprecationWarning)]
assert ("<string>", "bridges.torch moved to forge_grain.bridges.torch; the old name goes in forge-grain 0.2") in said, said
"""


def test_the_wheel_installs_one_package_and_the_old_bridges_name_still_imports(tmp_path):
    """`pip wheel .` holds `forge_grain` only (no top-level `bridges` to clash with PyPI's
    package of that name or a project's folder), and a script written for 0.1's
    `from bridges.torch import ...` still runs, warned, before it imports forge_grain."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("forge_grain-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["forge_grain"]
        z.extractall(tmp_path / "site")
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"forge_grain", "forge_grain_old_names.pth"}, tops
    assert "forge_grain/bridges/torch.py" in names
    r = subprocess.run([sys.executable, "-c", OLD_BRIDGES, str(tmp_path / "site")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_project_folder_named_bridges_is_not_taken_over(tmp_path):
    """The old name serves only where nothing else is called `bridges`."""
    (tmp_path / "bridges").mkdir()
    (tmp_path / "bridges" / "__init__.py").write_text("MINE = True\n")
    code = "import forge_grain, bridges; assert bridges.MINE and not hasattr(bridges, 'torch'), bridges.__file__"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
