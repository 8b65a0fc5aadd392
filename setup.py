"""What pyproject.toml cannot say: the wheel also installs `forge_grain_old_names.pth`, one
line that lets the bridges' old top-level name (`import bridges.torch`) import, with a
DeprecationWarning, until 0.2 (see forge_grain/moved.py). The wheel's only package is
`forge_grain`."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "forge_grain_old_names.pth"


class BuildWithOldNames(build_py):
    """build_py, plus the .pth at the top of the build (installed into site-packages)."""

    def run(self):
        super().run()
        if not self.editable_mode:  # (an editable install's own finder serves the checkout)
            self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithOldNames})
