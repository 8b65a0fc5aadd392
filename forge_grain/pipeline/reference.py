"""The configuration reference (`docs/config.md`), generated from the fields of `DataConfig`,
`Phase` and `SourceConfig` and the docstring written under each field.

Python keeps no attribute docstrings at run time, so they are read from the source with
`ast`; the reference cannot drift from the code, and `tests/test_config_reference.py`
fails when a field has no docstring or example, or when `docs/config.md` is stale.
Regenerate it with `forge-grain config-reference > docs/config.md`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from forge_grain.pipeline.config import DataConfig, Phase, SourceConfig

CLASSES = (DataConfig, SourceConfig, Phase)
EXAMPLE = "Example:"

INTRO = """\
# Configuration reference

Every key of a forge-grain config: its type, its default, what it means and an example.
This page is generated from the code (`forge-grain config-reference > docs/config.md`); a
test fails when a key is undocumented or the page is stale.

A config is a TOML file, its keys at the top level or under a `[data]` table, read by
`DataConfig.from_toml(path)` (`forge-grain plan CONFIG` previews the run it describes), or
the same keys in Python: `DataConfig(...)`, `DataConfig.from_dict({...})`. Sources are
`[[sources]]` tables and phases `[[phases]]` tables. An unknown key, a missing required key
or a value of the wrong type is an error naming it. A KempnerForge job file is read with
KempnerForge's own keys and meaning (see docs/peers/kempnerforge.md).

```toml
seq_len = 2048
global_batch_size = 512
seed = 1234

[[sources]]
name = "web"
path = "data/web"
weight = 0.7
strategy = "bos_bestfit"

[[sources]]
name = "code"
path = "data/code"
weight = 0.3

[[phases]]
start_step = 10000
weights = { web = 0.3, code = 0.7 }
```
"""

SECTIONS = {
    DataConfig: "`DataConfig`: the run",
    SourceConfig: "`SourceConfig`: one source (a `[[sources]]` table)",
    Phase: "`Phase`: a mixture change (a `[[phases]]` table)",
}


def field_docs(cls) -> dict[str, tuple[str, str | None]]:
    """Each field of the dataclass `cls`: (its annotation as written, the docstring under it)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                doc = inspect.cleandoc(after.value.value)
            out[node.target.id] = (ast.unparse(node.annotation), doc)
    return out


def undocumented(classes=CLASSES) -> list[str]:
    """'Class.field' for every field without a docstring, or whose docstring has no example."""
    return [f"{cls.__name__}.{name}" for cls in classes for name, (_, doc) in field_docs(cls).items()
            if not doc or EXAMPLE not in doc or not doc.split(EXAMPLE, 1)[1].strip()]


def examples(cls) -> dict[str, str]:
    """Each documented field's example (TOML)."""
    return {name: doc.split(EXAMPLE, 1)[1].strip() for name, (_, doc) in field_docs(cls).items()
            if doc and EXAMPLE in doc}


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "default: unset"
    if isinstance(value, bool):
        return f"default: `{str(value).lower()}`"
    if isinstance(value, str):
        return f'default: `"{value}"`'
    return f"default: `{value!r}`"


def _entry(name: str, annotation: str, doc: str, f: dataclasses.Field) -> str:
    meaning, example = (part.strip() for part in doc.split(EXAMPLE, 1))
    return f"### `{name}`\n\n`{annotation}` · {_default(f)}\n\n{meaning}\n\n```toml\n{example}\n```\n"


def render() -> str:
    """The reference as Markdown."""
    parts = [INTRO]
    for cls in CLASSES:
        docs = field_docs(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"## {SECTIONS[cls]}\n\n{summary}\n\nKeys: " + ", ".join(f"`{n}`" for n in docs) + "\n")
        parts += [_entry(name, annotation, doc or "", fields[name]) for name, (annotation, doc) in docs.items()]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
