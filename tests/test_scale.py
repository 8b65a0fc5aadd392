"""Scale: many shard files and many sources under a cluster's descriptor limit.

Each case runs in a fresh process whose `ulimit -n` is 256 (clusters commonly give 1024),
reads batches, restores a saved state in a new pipeline, and must get the same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from forge_grain import prepare
from forge_grain.writer import write_store

LIMIT = 256

# Reads 6 batches, then resumes from the state after 3 in a new pipeline; prints open descriptors.
RESUME = textwrap.dedent("""\
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
    import numpy as np
    from forge_grain import DataConfig, Pipeline
    config = DataConfig.from_dict(json.loads(open(sys.argv[1]).read()))
    pipe = Pipeline(config, 0, 1, cache_dir=sys.argv[2])
    it = pipe.iterator()
    batches = [next(it) for _ in range(6)]
    state = pipe.state_at(3)
    again = Pipeline(config, 0, 1, cache_dir=sys.argv[2]).iterator(state)
    for want in batches[3:]:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want), "resumed batches differ"
    print("fds", len(os.listdir("/proc/self/fd")), "tokens", int(sum(b["loss_mask"].sum() for b in batches)))
""").format(limit=LIMIT)


def run_limited(config: dict, work, max_open: int | None = None) -> tuple[int, int]:
    (work / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "FORGE_GRAIN_MAX_OPEN_FILES": str(max_open)} if max_open else None
    r = subprocess.run([sys.executable, "-c", RESUME, str(work / "config.json"), str(work / "cache")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    _, fds, _, tokens = r.stdout.split()
    return int(fds), int(tokens)


def docs_jsonl(path, n_docs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"ids": [0, *rng.integers(2, 1000, int(rng.integers(5, 60))).tolist()]}) + "\n")
    return path


@pytest.mark.parametrize("layout", ["bin", "arrayrecord"])
def test_a_store_of_2000_shard_files_iterates_and_resumes_under_ulimit_256(tmp_path, layout):
    out = prepare(docs_jsonl(tmp_path / "docs.jsonl", 6000), tmp_path / "store", token_field="ids", vocab_size=1000,
                  bos_id=0, layout=layout, num_shards=2000, progress=False)
    assert len(list(out.glob("shard-*.idx.npy"))) == 2000
    config = dict(sources=[dict(name="s", path=str(out), strategy="bestfit")], seq_len=32, global_batch_size=64, seed=3)
    fds, tokens = run_limited(config, tmp_path, max_open=40)
    assert fds < 40 + 24 and tokens > 0  # ArrayRecord readers within the pool's cap, plus the process's own


def test_a_directory_of_1200_token_files_opens_under_ulimit_256(tmp_path):
    """KempnerForge's layout: one `tokenized_*.npy` per input file, read in place."""
    rng = np.random.default_rng(1)
    for i in range(1200):
        np.save(tmp_path / f"tokenized_{i:05d}.npy", np.concatenate([rng.integers(2, 1000, 40), [1]]).astype(np.uint16))
    config = dict(sources=[dict(name="kf", path=str(tmp_path), eos_id=1, strategy="concat")], seq_len=32,
                  global_batch_size=16, seed=0)
    fds, _ = run_limited(config, tmp_path)
    assert fds < 64


def test_a_pipeline_of_1000_sources_iterates_and_resumes_under_ulimit_256(tmp_path):
    rng = np.random.default_rng(2)
    sources = []
    for i in range(1000):
        docs = [np.concatenate([[0], rng.integers(2, 1000, int(rng.integers(5, 50)))]) for _ in range(8)]
        path = write_store(tmp_path / f"s{i:04d}", docs, vocab_size=1000, bos_id=0, eos_id=1)
        sources.append(dict(name=f"s{i:04d}", path=str(path), weight=1 + i % 3, strategy="bestfit"))
    config = dict(sources=sources, seq_len=32, global_batch_size=64, seed=5)
    fds, tokens = run_limited(config, tmp_path)
    assert fds < 64 and tokens > 0
