"""docs/config.md: every config key documented from the code, with examples that parse."""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from forge_grain import DataConfig
from forge_grain.pipeline.reference import CLASSES, INTRO, examples, render, undocumented

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_every_key_has_a_docstring_with_an_example():
    assert undocumented() == [], "document these fields (a docstring under the field, ending with 'Example: ...')"


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == render(), "regenerate it: forge-grain config-reference > docs/config.md"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_example_is_toml_that_sets_its_key(cls):
    for name, example in examples(cls).items():
        parsed = tomllib.loads(example)
        assert name in parsed, (cls.__name__, name, example)


def test_the_introduction_example_is_a_valid_config():
    block = re.search(r"```toml\n(.*?)```", INTRO, re.S).group(1)
    cfg = DataConfig.from_dict(tomllib.loads(block))
    assert [s.name for s in cfg.sources] == ["web", "code"] and cfg.phases[0].start_step == 10000


def test_a_field_without_a_docstring_is_named(tmp_path, monkeypatch):
    (tmp_path / "fields.py").write_text(textwrap.dedent('''
        import dataclasses

        @dataclasses.dataclass
        class Settings:
            documented: int = 1
            """What it does.
            Example: documented = 2"""

            bare: int = 0

            no_example: int = 0
            """What it does, but no example."""
    '''))
    spec = importlib.util.spec_from_file_location("fields", tmp_path / "fields.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fields", module)  # where `inspect` finds a class's source
    spec.loader.exec_module(module)
    assert undocumented([module.Settings]) == ["Settings.bare", "Settings.no_example"]


def test_the_readme_links_the_reference():
    assert "docs/config.md" in (DOC.parents[1] / "README.md").read_text()
