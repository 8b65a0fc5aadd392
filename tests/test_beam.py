"""`prepare --runner beam`: an Apache Beam job (the local runners here) writes the bytes local
`prepare` writes, resumes after a kill, and names a bad row's file and row as local `prepare` does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("apache_beam")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from conftest import make_texts, tree_bytes  # noqa: E402

from forge_grain import PrepareError, TokenStore, prepare  # noqa: E402
from forge_grain.tokenizer import DEFAULT_TOKENIZER  # noqa: E402

MULTI = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]  # two worker processes


@pytest.fixture(autouse=True)
def beam_temporaries(tmp_path, monkeypatch):
    """Every test's system temporary directory is one of its own, and its jobs leave it as
    they found it: Beam's local runner left seven empty directories there for every `prepare`
    (its SDK's staging, its job servers' roots, its requirements cache)."""
    system = tmp_path / "system-tmp"
    system.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system))
    monkeypatch.setenv("TMPDIR", str(system))  # (the jobs run in child processes too)
    yield
    assert sorted(p.name for p in system.iterdir()) == []


@pytest.fixture(scope="module")
def jsonl_dir(tmp_path_factory):
    """Three JSON Lines files with blank lines between some rows and a few empty documents."""
    d = tmp_path_factory.mktemp("jsonl")
    texts = make_texts(1500, seed=5, empty_every=60)
    for k in range(3):
        rows = texts[k * 500:(k + 1) * 500]
        (d / f"part-{k}.jsonl").write_text(
            "".join(json.dumps({"text": t, "n": i}) + "\n" + ("\n" if i % 97 == 3 else "") for i, t in enumerate(rows)))
    return d


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """Two Parquet files of several row groups: texts, and the same documents pre-tokenized."""
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("parquet")
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    texts = [t for t in make_texts(1200, seed=6) if t]
    for k in range(2):
        part = texts[k * 600:(k + 1) * 600]
        ids = [e.ids for e in tok.encode_batch(part, add_special_tokens=False)]
        pq.write_table(pa.table({"text": part, "ids": ids}), d / f"p{k}.parquet", row_group_size=128)
    return d


def same_store(a, b) -> None:
    """Byte-identical stores: every file (temporaries would show) and the manifest."""
    assert tree_bytes(a) == tree_bytes(b)
    assert TokenStore.open(b, verify=True).num_tokens > 0


def both(src, tmp_path, options=(), **kw):
    local = prepare(src, tmp_path / "local", progress=False, **kw)
    beam = prepare(src, tmp_path / "beam", progress=False, runner="beam", beam_options=list(options), **kw)
    return local, beam


def test_jsonl_files_make_the_bytes_of_local_prepare_on_two_worker_processes(jsonl_dir, tmp_path):
    same_store(*both(jsonl_dir, tmp_path, MULTI, num_shards=5))


@pytest.mark.parametrize("layout", ["bin", "arrayrecord"])
def test_parquet_files_make_the_bytes_of_local_prepare_with_a_tokenizer_file(parquet_dir, tmp_path, layout):
    tokenizer = shutil.copy(DEFAULT_TOKENIZER, tmp_path / "my-tokenizer.json")  # a local file, shipped in the job
    same_store(*both(parquet_dir, tmp_path, num_shards=4, layout=layout, tokenizer=tokenizer))


def test_pre_tokenized_parquet_and_the_default_shard_count_match_local_prepare(parquet_dir, tmp_path):
    local, beam = both(parquet_dir, tmp_path, token_field="ids", vocab_size=50_000, add_eos=True, eos_id=1)
    same_store(local, beam)
    assert len(TokenStore.open(beam).manifest.shards) == 1  # the default: 64 MiB of input a shard


@pytest.mark.slow
def test_the_cli_runs_a_beam_job_with_beam_options(jsonl_dir, tmp_path):
    local = prepare(jsonl_dir, tmp_path / "local", num_shards=3, progress=False)
    r = subprocess.run([sys.executable, "-m", "forge_grain", "prepare", str(jsonl_dir), str(tmp_path / "beam"),
                        "--num-shards", "3", "--runner", "beam", "--beam-option", "direct_num_workers=2",
                        "--beam-option", "direct_running_mode=multi_processing"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "beam: 3 shard(s) written, 0 already done; 1,500 rows" in r.stdout
    same_store(local, tmp_path / "beam")


KILLED = textwrap.dedent("""\
    import sys
    from forge_grain import prepare
    prepare(sys.argv[1], sys.argv[2], num_shards=24, runner="beam", progress=False)
""")


def test_a_job_killed_part_way_completes_on_a_rerun_with_the_same_bytes(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    texts = make_texts(12_000, seed=8)
    for k in range(4):
        (src / f"c{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[k * 3000:(k + 1) * 3000]))
    out = tmp_path / "beam"
    job = subprocess.Popen([sys.executable, "-c", KILLED, str(src), str(out)], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(list(out.glob("shard-*.done.json"))) < 3 and time.time() < deadline and job.poll() is None:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    for left in Path(tempfile.gettempdir()).iterdir():  # (what a killed process leaves: the rerun's are checked)
        shutil.rmtree(left)
    assert not (out / "manifest.json").exists(), "the job finished before it could be killed"
    finished = {f.with_name(f.name.replace(".done.json", ".bin")) for f in out.glob("shard-*.done.json")}
    finished = {f: f.stat().st_ino for f in finished}  # (a shard renamed into place, its marker not yet written
    assert finished, "no shard was finished before the kill"  # when the job was killed, is written again)
    prepare(src, out, num_shards=24, runner="beam", progress=False)
    assert {f: f.stat().st_ino for f in finished} == finished  # kept, not written again
    same_store(prepare(src, tmp_path / "local", num_shards=24, progress=False), out)


def bad_inputs(tmp_path):
    cases = {}
    d = tmp_path / "missing"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"} if i != 7 else {"other": 1}) + "\n"
                                       for i in range(40)))
    cases["missing field"] = (d, {}, r"b\.jsonl, row 7: the text is null")
    d = tmp_path / "utf8"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    (d / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    cases["not UTF-8"] = (d, {}, r"b\.jsonl, row 1: field 'text' holds bytes that are not UTF-8")
    d = tmp_path / "ids"
    d.mkdir()
    pq.write_table(pa.table({"ids": [[5, 6, 7]] * 30 + [[5, 70_000]] + [[8]] * 9}), d / "t.parquet", row_group_size=8)
    cases["id past the vocabulary"] = (d, dict(token_field="ids", vocab_size=1000),
                                       r"t\.parquet, row 30: token id 70000 is outside the vocabulary")
    return cases


@pytest.mark.parametrize("case", ["missing field", "not UTF-8", "id past the vocabulary"])
def test_a_bad_row_fails_the_job_naming_its_file_and_row_as_local_prepare_does(tmp_path, case):
    src, kw, pattern = bad_inputs(tmp_path)[case]
    messages = []
    for runner in ("local", "beam"):
        with pytest.raises(PrepareError, match=pattern) as e:
            prepare(src, tmp_path / runner, num_shards=2, progress=False, runner=runner, **kw)
        messages.append(str(e.value))
        assert not (tmp_path / runner / "manifest.json").exists()
    assert messages[0] == messages[1]


def test_inputs_the_beam_runner_does_not_read_are_refused_by_name(tmp_path):
    (tmp_path / "a.txt").write_text("plain text\n")
    with pytest.raises(PrepareError, match=r"a\.txt: --runner beam reads JSON Lines and Parquet files, not text"):
        prepare(tmp_path / "a.txt", tmp_path / "out", runner="beam", progress=False)


def test_inputs_and_output_in_object_storage_make_the_local_shards(jsonl_dir, tmp_path):
    pytest.importorskip("moto")
    from s3server import S3Server

    s3 = S3Server()
    try:
        fs = s3.fs()
        fs.mkdir("beam-test")  # moto keeps one state per process: a bucket of its own
        fs.put(str(jsonl_dir), "beam-test/in", recursive=True)
        local = prepare(jsonl_dir, tmp_path / "local", num_shards=4, progress=False)
        url = prepare("s3://beam-test/in", "s3://beam-test/out", num_shards=4, runner="beam", progress=False,
                      storage_options=s3.options())
        assert url == "s3://beam-test/out"
        names = [s for f in json.loads((local / "manifest.json").read_text())["shards"] for s in (f["tokens"], f["index"])]
        names.append("shards.idx.npy")  # every shard's index joined: what opening the store reads
        assert all(fs.cat_file(f"beam-test/out/{n}") == (local / n).read_bytes() for n in names)
        remote = json.loads(fs.cat_file("beam-test/out/manifest.json"))
        mine = json.loads((local / "manifest.json").read_text())
        assert {k: v for k, v in remote.items() if k != "source"} == {k: v for k, v in mine.items() if k != "source"}
        assert sorted(fs.ls("beam-test/out", detail=False)) == sorted(f"beam-test/out/{n}" for n in names + ["manifest.json"])
        store = TokenStore.open(url, storage_options=s3.options(), object_cache=str(tmp_path / "cache"), verify=True)
        assert len(store) == len(TokenStore.open(local))
        again = prepare("s3://beam-test/in", "s3://beam-test/out", num_shards=4, runner="beam", progress=False,
                        storage_options=s3.options())  # complete: stops at the manifest
        assert again == url
    finally:
        s3.stop()


def broken_inputs(tmp_path) -> dict:
    cases = {}
    d = tmp_path / "float-ids"
    d.mkdir()
    pq.write_table(pa.table({"ids": [[1.5, 2.0]] * 20}), d / "f.parquet")
    cases["float token ids"] = (d / "f.parquet", dict(token_field="ids", vocab_size=100),
                                r"f\.parquet: --token-field 'ids' must hold lists of integer ids, not .*float64")
    d = tmp_path / "int-text"
    d.mkdir()
    pq.write_table(pa.table({"text": list(range(20))}), d / "n.parquet")
    cases["numbers as text"] = (d / "n.parquet", {}, r"n\.parquet: field 'text' must hold text \(strings\)")
    d = tmp_path / "cut-parquet"
    d.mkdir()
    pq.write_table(pa.table({"text": ["hello world"] * 500}), d / "c.parquet")
    data = (d / "c.parquet").read_bytes()
    (d / "c.parquet").write_bytes(data[: len(data) // 2])
    cases["truncated Parquet"] = (d / "c.parquet", {}, r"c\.parquet: not a readable Parquet file .*truncated")
    d = tmp_path / "cut-jsonl"
    d.mkdir()
    (d / "c.jsonl").write_text('{"text": "a"}\n{"text": "b')
    cases["truncated JSON Lines"] = (d / "c.jsonl", {}, r"c\.jsonl: cannot read rows 0-2 as JSON Lines")
    return cases


@pytest.mark.parametrize("case", ["float token ids", "numbers as text", "truncated Parquet", "truncated JSON Lines"])
def test_a_wrong_dtype_type_or_truncated_file_is_refused_naming_the_file(tmp_path, case):
    src, kw, pattern = broken_inputs(tmp_path)[case]
    with pytest.raises(PrepareError, match=pattern):
        prepare(src.parent, tmp_path / "out", num_shards=1, progress=False, runner="beam", **kw)
    assert not (tmp_path / "out" / "manifest.json").exists()
