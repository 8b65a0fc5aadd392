"""`forge-grain demo`: the whole flow on a corpus that needs no download.

The corpus is this Python's own standard library: its source files (a "code"
source) and their docstrings (a "docs" source), tokenized with the tokenizer
shipped in the package.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import time
from pathlib import Path

from .preparation import prepare
from .store import TokenStore
from .summary import format_summary


def stdlib_files(max_files: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and "test" not in p.parts]
    return files[:max_files]


def write_demo_corpus(workdir: Path, max_files: int = 600) -> dict[str, Path]:
    """Write `code.jsonl` and `docs.jsonl` under `workdir` (atomically; reused when present)."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"code": workdir / "code.jsonl", "docs": workdir / "docs.jsonl"}
    if all(p.exists() for p in paths.values()):
        return paths
    code, docs = [], []
    for f in stdlib_files(max_files):
        text = f.read_text(encoding="utf-8", errors="replace")
        code.append({"text": text, "file": f.name})
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if doc := ast.get_docstring(node):
                    docs.append({"text": doc, "file": f.name})
    for name, rows in (("code", code), ("docs", docs)):
        tmp = paths[name].with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, paths[name])
    return paths


def run_demo(workdir: str | Path = "forge-grain-demo", *, max_files: int = 600, num_proc: int = 2) -> dict:
    """Prepare the demo corpus and print what each step produced; returns the figures."""
    t0 = time.perf_counter()
    workdir = Path(workdir)
    print(f"forge-grain demo in {workdir.resolve()}")
    corpus = write_demo_corpus(workdir, max_files)
    stores = {}
    for name, layout in (("code", "bin"), ("docs", "arrayrecord")):
        out = prepare(corpus[name], workdir / "stores" / name, layout=layout, num_proc=num_proc)
        stores[name] = TokenStore.open(out, verify=True)
        print(format_summary(stores[name]))
    summary = {name: {"documents": len(s), "tokens": s.num_tokens} for name, s in stores.items()}
    print(
        "\nsummary: "
        + ", ".join(f"{n}: {v['documents']:,} documents / {v['tokens']:,} tokens" for n, v in summary.items())
        + f"  ({time.perf_counter() - t0:.1f} s)"
    )
    return summary
