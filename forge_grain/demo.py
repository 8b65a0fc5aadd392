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

import numpy as np
from tqdm.auto import tqdm

from forge_grain.pipeline.config import DataConfig
from forge_grain.files import write_json_atomic, write_text_atomic
from forge_grain.pipeline.pipeline import Pipeline
from forge_grain.preparation.runners import prepare
from forge_grain.stores import TokenStore
from forge_grain.packing.summary import format_summary


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


def write_demo_config(workdir: Path, steps: int) -> Path:
    """The demo's config as TOML (`workdir/data.toml`, store paths relative to it), for
    `forge-grain plan` and for training scripts; `run_demo` reads it back, so it is exactly
    the config the demo runs."""
    switch = steps // 2
    text = (
        "# the forge-grain demo's data: two sources, a mixture that switches at half the run\n"
        "seq_len = 1024\nglobal_batch_size = 16\nseed = 0\nnum_epochs = inf\n"
        f"max_steps = {steps}\n\n"
        '[[sources]]\nname = "code"\npath = "stores/code"\nweight = 0.7\nstrategy = "bestfit"\n\n'
        '[[sources]]\nname = "docs"\npath = "stores/docs"\nweight = 0.3\nstrategy = "bos_bestfit"\n\n'
        f"[[phases]]\nstart_step = {switch}\nweights = {{ code = 0.2, docs = 0.8 }}\n"
    )
    path = workdir / "data.toml"
    write_text_atomic(path, text)
    return path


def run_demo(workdir: str | Path = "forge-grain-demo", *, max_files: int = 600, num_proc: int = 2, steps: int = 60) -> dict:
    """Prepare, pack, mix, iterate, checkpoint and resume on the demo corpus; print a summary."""
    t0 = time.perf_counter()
    workdir = Path(workdir)
    print(f"forge-grain demo in {workdir.resolve()}\n")
    corpus = write_demo_corpus(workdir, max_files)
    stores = {}
    for name, layout in (("code", "bin"), ("docs", "arrayrecord")):
        out = prepare(corpus[name], workdir / "stores" / name, layout=layout, num_proc=num_proc)
        stores[name] = TokenStore.open(out, verify=True)
        print(format_summary(stores[name]) + "\n")

    config_path = write_demo_config(workdir, steps)
    config = DataConfig.from_toml(config_path)
    switch = config.phases[0].start_step
    print(f"pipeline: 2 sources, seq_len {config.seq_len}, global batch {config.global_batch_size}, "
          f"mix code 0.7 / docs 0.3, switching to 0.2 / 0.8 at step {switch}; 2 shards")
    hosts = [Pipeline(config, k, 2) for k in range(2)]
    for name, ds in zip(("code", "docs"), hosts[0].datasets):
        st = ds.stats
        print(f"  {name}: {st['strategy']}, {st['rows']:,} rows/epoch, fill {st['fill']:.2%}, "
              f"cropped {st['cropped_share']:.2%}, {st['docs_per_row']:.2f} documents/row")
    iters = [iter(h) for h in hosts]
    checkpoint_at = steps // 3
    state_path = workdir / "checkpoint" / "data_state.json"
    state_path.parent.mkdir(exist_ok=True)
    reference, mix_before, mix_after, tokens = {}, np.zeros(2), np.zeros(2), 0
    hosts[0].batch(0)  # compile the kernels (cached on disk after the first run) before timing
    t_iter = time.perf_counter()
    for step in tqdm(range(steps), desc="train (2 shards)", unit="step"):
        if step == checkpoint_at:
            write_json_atomic(state_path, iters[0].get_state())  # one state for every shard count
        parts = [next(it) for it in iters]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in ("inputs", "source_id", "loss_mask")}
        reference[step] = batch
        counts = np.bincount(batch["source_id"], minlength=2)
        (mix_before if step < switch else mix_after)[:] += counts
        tokens += batch["inputs"].size
    elapsed = time.perf_counter() - t_iter
    for it in iters:
        it.close()

    state = json.loads(state_path.read_text())
    checks = {}
    for shards in (1, 4):
        resumed = [Pipeline(config, k, shards).iterator(state) for k in range(shards)]
        ok = True
        for step in range(state["step"], steps):
            parts = [next(it) for it in resumed]
            got = np.concatenate([p["inputs"] for p in parts])
            ok &= bool(np.array_equal(got, reference[step]["inputs"]))
        for it in resumed:
            it.close()
        checks[shards] = ok
        print(f"resume from step {state['step']} on {shards} shard(s): batches {state['step']}..{steps - 1} "
              f"{'match' if ok else 'DIFFER from'} the uninterrupted 2-shard run")

    share = lambda c: f"code {c[0] / c.sum():.2f} / docs {c[1] / c.sum():.2f}"  # noqa: E731
    summary = {
        "documents": {n: len(s) for n, s in stores.items()},
        "tokens": {n: s.num_tokens for n, s in stores.items()},
        "steps": steps,
        "tokens_per_second": tokens / elapsed,
        "resume_matches": checks,
    }
    print(
        f"\nsummary: {steps} steps, {tokens:,} tokens in {elapsed:.2f} s ({tokens / elapsed / 1e6:.1f} M tokens/s); "
        f"rows before the switch: {share(mix_before)}, after: {share(mix_after)}; "
        f"resume on 1 and 4 shards exact: {all(checks.values())}  ({time.perf_counter() - t0:.1f} s in all)"
    )
    print(f"next: see the run this config describes, before training:\n  forge-grain plan {config_path}\n")
    print("next: train a tiny GPT on this corpus, checkpoint, kill, resume and compare loss curves with\n"
          "  python examples/train_torch.py   (PyTorch: StatefulDataLoader over forge_grain.bridges.torch;\n"
          "                                    first: pip install -e '.[torch]')\n"
          "  python examples/train_jax.py     (JAX: global jax.Arrays, Orbax checkpoint of model and data;\n"
          "                                    first: pip install -e '.[jax]')")
    return summary
