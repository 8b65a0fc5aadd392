"""What a user sees on stderr: progress bars and nothing else. No traceback at exit, no
"Exception ignored", no warning a user cannot act on (Grain's jax profiler without jax,
Beam's chatter, torchdata's deprecation, generators and memory maps finalized too late),
and one progress bar per job, not one per rank.

Each case runs as a user's script would, in its own interpreter, and exits without
closing anything: the noise this guards against appears at interpreter exit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import make_texts, noise, store, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def run_script(tmp_path: Path, body: str, *args: str, spawns: bool = False) -> subprocess.CompletedProcess:
    """`body` as a user's main script, at module level so that what it made lives until
    interpreter exit; one that `spawns` worker processes runs under the `__main__` guard
    (the workers import the script again) and keeps its objects in globals."""
    body = textwrap.dedent(body)
    if spawns:
        body = "def main():\n%s\n\nif __name__ == '__main__':\n    main()\n" % textwrap.indent(body, "    ")
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.path[:0] = [%r, %r]\n\n%s" % (str(ROOT), str(ROOT / "tests"), body))
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done" in r.stdout
    return r


def silent(r: subprocess.CompletedProcess) -> None:
    assert noise(r.stderr) == [], r.stderr


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("silence")
    return {k: str(store(base / k, 300, i)) for i, k in enumerate(("web", "code", "math"))}


def config_code(stores: dict, **extra) -> str:
    sources = [dict(name=k, path=p, weight=w, strategy="bestfit") for (k, p), w in zip(stores.items(), (5, 3, 2))]
    return f"DataConfig.from_dict({dict(sources=sources, seq_len=64, global_batch_size=8, seed=3, **extra)!r})"


def test_a_pipeline_with_worker_processes_exits_quietly_without_close(tmp_path, stores):
    silent(run_script(tmp_path, f"""
        global it, batch  # alive at exit, as in a script that iterates at module level
        from forge_grain import DataConfig, Pipeline
        it = iter(Pipeline({config_code(stores)}, 0, 1, worker_count=2, cache_dir="plans"))
        for _ in range(5):
            batch = next(it)
        print("done")
    """, spawns=True))


def test_grain_without_jax_says_nothing_about_a_profiler(tmp_path, stores):
    # jax made unimportable, as where it is not installed (the README's first command)
    r = run_script(tmp_path, f"""
        sys.modules["jax"] = None
        from forge_grain import DataConfig, Pipeline
        p = Pipeline({config_code(stores)}, 0, 1, cache_dir="plans")
        next(iter(p))
        print("done")
    """)
    silent(r)


def test_torch_loaders_over_the_bridge_print_no_deprecation(tmp_path, stores):
    pytest.importorskip("torchdata")
    silent(run_script(tmp_path, f"""
        from forge_grain.bridges.torch import GrainIterableDataset
        from forge_grain import DataConfig
        from torchdata.stateful_dataloader import StatefulDataLoader
        ds = GrainIterableDataset({config_code(stores)}, rank=0, world_size=1)
        for workers in (0, 2):
            it = iter(StatefulDataLoader(ds, batch_size=None, num_workers=workers))
            for _ in range(3):
                next(it)
        print("done")
    """))


def test_a_streaming_parquet_source_left_mid_file_exits_quietly(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_texts(900, seed=4)
    files = []
    for k in range(2):
        files.append(str(tmp_path / f"part-{k}.parquet"))
        pq.write_table(pa.table({"text": texts[k::2]}), files[-1], row_group_size=100)
    src = dict(name="web", hf_dataset="parquet", hf_data_files=files, hf_streaming=True, window=40)
    silent(run_script(tmp_path, f"""
        from forge_grain import DataConfig, Pipeline
        cfg = DataConfig.from_dict({dict(sources=[src], seq_len=48, global_batch_size=8, seed=5, canonical_streams=2)!r})
        it = iter(Pipeline(cfg, 0, 1, cache_dir="cache"))
        for _ in range(3):
            next(it)
        print("done")
    """))


def test_a_store_read_from_object_storage_exits_quietly(tmp_path, stores):
    pytest.importorskip("s3fs")
    from s3server import S3Server

    server = S3Server()
    try:
        fs = server.fs()
        fs.mkdir("silence")  # moto's buckets are per process: a name no other test module uses
        fs.put(stores["web"], "silence/web", recursive=True)
        src = dict(name="web", path="s3://silence/web", storage_options=server.options(),
                   object_cache=str(tmp_path / "objects"))
        silent(run_script(tmp_path, f"""
            from forge_grain import DataConfig, Pipeline
            cfg = DataConfig.from_dict({dict(sources=[src], seq_len=64, global_batch_size=8, seed=1)!r})
            it = iter(Pipeline(cfg, 0, 1, cache_dir="plans"))
            for _ in range(4):
                next(it)
            print("done")
        """))
    finally:
        server.stop()


def test_a_local_beam_prepare_prints_its_summary_and_nothing_else(tmp_path):
    pytest.importorskip("apache_beam")
    (tmp_path / "corpus").mkdir()
    for k in range(3):
        write_jsonl(tmp_path / "corpus" / f"part-{k}.jsonl", make_texts(100, seed=k))
    r = subprocess.run([sys.executable, "-m", "forge_grain", "prepare", str(tmp_path / "corpus"), str(tmp_path / "out"),
                        "--runner", "beam", "--num-shards", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "beam: 3 shard(s) written" in r.stdout
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_documents"] == 300
    assert noise(r.stderr) == [], r.stderr


def test_only_shard_zero_shows_the_planning_bar(tmp_path, stores):
    # three chunks of 100 documents: a bar while planning; each shard plans into its own cache
    body = f"""
        from forge_grain import DataConfig, Pipeline
        Pipeline({config_code(stores, plan_chunk_docs=100)}, int(sys.argv[1]), 2, cache_dir=sys.argv[2], plan_workers=1)
        print("done")
    """
    first = run_script(tmp_path, body, "0", str(tmp_path / "plans0"))
    other = run_script(tmp_path, body, "1", str(tmp_path / "plans1"))
    assert "plan " in first.stderr and "3/3" in first.stderr
    assert other.stderr == ""
