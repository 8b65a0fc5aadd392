"""Issue 27: caches another user could write are never loaded, and caches that lie are caught."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from conftest import config, index_cache, store

from forge_grain import Pipeline, TokenStore
from forge_grain.paths import UntrustedCacheError, private_cache


def test_a_cache_directory_others_can_write_is_refused_by_name(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedCacheError, match=f"{shared}: is writable by group or others.*FORGE_GRAIN_CACHE"):
        private_cache(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(UntrustedCacheError, match="not a directory"):
        private_cache(link)
    fresh = private_cache(tmp_path / "mine" / "cache")
    assert fresh.stat().st_mode & 0o777 == 0o700
    if os.getuid() == 0:  # root can hand a directory to another user: the planted case
        planted = tmp_path / "planted"
        planted.mkdir(mode=0o755)
        os.chown(planted, 65534, 65534)
        with pytest.raises(UntrustedCacheError, match="owned by another user"):
            private_cache(planted)


def test_every_parent_of_a_cache_up_to_the_root_directory_is_checked(tmp_path, monkeypatch):
    """As ssh checks the parents of authorized_keys: a cache root below a directory others can
    write without the sticky bit (they could rename the cache away and plant their own) is
    refused naming that parent; with the sticky bit (as /tmp) it is safe."""
    above = tmp_path / "shared-parent"
    above.mkdir()
    above.chmod(0o777)
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(above / "me" / "forge_grain"))
    with pytest.raises(UntrustedCacheError, match=rf"{above}: \(a parent of the cache\) is writable by group or "
                                                  r"others without the sticky bit \(mode 777\)"):
        private_cache(above / "me" / "forge_grain" / "plans")
    deeper = tmp_path / "a" / "b"
    deeper.mkdir(parents=True)
    (tmp_path / "a").chmod(0o757)  # two levels above: still found
    with pytest.raises(UntrustedCacheError, match=rf"{tmp_path / 'a'}: \(a parent of the cache\)"):
        private_cache(deeper / "cache")
    (tmp_path / "a").chmod(0o755)
    above.chmod(0o1777)  # sticky, as /tmp: others cannot rename what they do not own
    assert private_cache(above / "me" / "forge_grain" / "plans").is_dir()
    if os.getuid() == 0:
        other = tmp_path / "others"
        other.mkdir(mode=0o755)
        os.chown(other, 65534, 65534)
        with pytest.raises(UntrustedCacheError, match=rf"{other}: \(a parent of the cache\) is owned by another user"):
            private_cache(other / "mine" / "cache")


def test_a_pipeline_with_a_shared_cache_dir_refuses_it(tmp_path, monkeypatch):
    path = three(tmp_path)
    shared = tmp_path / "cache"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedCacheError, match=str(shared)):
        Pipeline(config(path), 0, 1, num_threads=0, cache_dir=shared)
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(shared))
    with pytest.raises(UntrustedCacheError, match=str(shared)):
        Pipeline(config(path), 0, 1, num_threads=0)


def three(tmp_path):
    return {name: store(tmp_path / name, 150, k) for k, name in enumerate(("web", "code", "math"))}


def raw_file(tmp_path, n_docs=100, eos=1):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 5000, rng.integers(5, 60)), eos) for _ in range(n_docs)]
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "a.npy", np.concatenate(docs).astype(np.uint16))
    return tmp_path / "d", docs


def test_an_index_cache_that_drops_eos_boundaries_is_rescanned(tmp_path):
    """Self-consistent (counts, checksum, ends) but 10 documents for 100: the sampled EOS ids
    that are not boundaries give it away."""
    d, docs = raw_file(tmp_path)
    assert len(TokenStore.open(d, eos_id=1)) == 100
    idx, meta_path = index_cache(d / "a.npy")
    offsets = np.load(idx)
    lying = offsets[::10].copy()
    lying[-1] = offsets[-1]
    with open(idx, "wb") as f:
        np.save(f, lying)
    meta = json.loads(meta_path.read_text())
    meta.update(num_documents=len(lying) - 1, offsets_sha256=hashlib.sha256(lying.astype(np.int64).tobytes()).hexdigest())
    meta_path.write_text(json.dumps(meta))
    store = TokenStore.open(d, eos_id=1)
    assert len(store) == 100 and [x.tolist() for x in store] == [x.tolist() for x in docs]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_an_index_cache_written_by_another_user_is_not_read(tmp_path, caplog):
    d, docs = raw_file(tmp_path)
    TokenStore.open(d, eos_id=1)
    for f in index_cache(d / "a.npy"):
        os.chown(f, 65534, 65534)
    with caplog.at_level("WARNING"):
        assert len(TokenStore.open(d, eos_id=1)) == 100
    assert "written by another user" in caplog.text


def test_no_index_cache_beside_data_in_a_directory_others_can_write(tmp_path, monkeypatch):
    """Even when caches beside the data are asked for."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_GRAIN_CACHE_BESIDE_DATA", "1")
    d, _ = raw_file(tmp_path)
    d.chmod(0o1777)  # a shared sticky directory, as /tmp
    TokenStore.open(d, eos_id=1)
    assert not list(d.glob(".forge-grain")) and list((tmp_path / "cache" / "index").iterdir())


def test_plans_beside_a_store_in_a_directory_others_can_write_are_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_GRAIN_CACHE_BESIDE_DATA", "1")
    path = three(tmp_path)
    (path["web"] / ".forge-grain" / "plans").mkdir(parents=True)
    (path["web"] / ".forge-grain" / "plans").chmod(0o777)
    Pipeline(config(path), 0, 1, num_threads=0).batch(0)
    assert not list((path["web"] / ".forge-grain" / "plans").iterdir())
    assert list((tmp_path / "cache" / "plans").iterdir())


def test_a_native_store_checks_sampled_ids_at_open(tmp_path):
    """A token flipped out of the vocabulary, or a manifest whose vocab_size was edited down, is
    caught at open (not only by verify=True)."""
    path = store(tmp_path / "s", 150, 0)  # vocabulary 1000
    TokenStore.open(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["vocab_size"] = 10
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shard-00000.bin.*vocab"):
        TokenStore.open(path)
    manifest["vocab_size"] = 1000
    (path / "manifest.json").write_text(json.dumps(manifest))
    tokens = np.memmap(path / "shard-00000.bin", dtype=np.uint16, mode="r+")
    tokens[len(tokens) // 2] = 65535
    tokens.flush()
    del tokens
    with pytest.raises(ValueError, match="65535"):
        TokenStore.open(path)


def test_16_bit_ids_declared_8_bit_are_refused(tmp_path):
    """nanoGPT-style uint16 data declared uint8 (vocab 256): every id's high byte becomes a
    token; the width checks apply to declared dtypes too."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 50_000, rng.integers(20, 400)), 1) for _ in range(500)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"16-bit ids read as 8-bit\. Declare dtype='uint16'"):
        TokenStore.open(tmp_path / "train.bin", dtype="uint8", vocab_size=256)
    rng.integers(0, 256, 100_000).astype(np.uint8).tofile(tmp_path / "bytes.bin")  # real 8-bit ids open
    assert TokenStore.open(tmp_path / "bytes.bin", dtype="uint8", vocab_size=256).num_tokens == 100_000


def test_foreign_indices_may_only_name_their_own_files(tmp_path):
    """An MDS basename or an Arrow state.json filename of `../x` or an absolute path would read
    another dataset's file as data: refused, naming the index."""
    import datasets
    from mds_writer import write_mds

    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 900, rng.integers(5, 50)).astype(np.int32) for _ in range(200)]
    for name in ("mds", "other"):
        write_mds(tmp_path / name, {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], 100)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    for bad in ("../other/" + index["shards"][0]["raw_data"]["basename"],
                str(tmp_path / "other" / index["shards"][0]["raw_data"]["basename"])):
        index["shards"][0]["raw_data"]["basename"] = bad
        (tmp_path / "mds" / "index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="index.json: lists .* outside the dataset's directory"):
            TokenStore.open(tmp_path / "mds", token_field="tokens", vocab_size=1000)

    for name in ("arrow", "elsewhere"):
        datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]}).save_to_disk(str(tmp_path / name))
    state = json.loads((tmp_path / "arrow" / "state.json").read_text())
    state["_data_files"][0]["filename"] = "../elsewhere/" + state["_data_files"][0]["filename"]
    (tmp_path / "arrow" / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="state.json: lists .* outside the dataset's directory"):
        TokenStore.open(tmp_path / "arrow", vocab_size=1000)


HOSTILE_STATES = {
    "history an int": lambda s: s["config"].__setitem__("history", 3),
    "history entry a string": lambda s: s["config"].__setitem__("history", ["x"]),
    "weights short": lambda s: s["config"]["history"][0].__setitem__("schedule", [[0, [0.5]]]),
    "weight NaN": lambda s: s["config"]["history"][0].__setitem__("schedule", [[0, [float("nan"), 1.0, 1.0]]]),
    "unknown source": lambda s: s["config"]["history"][0].__setitem__("tree", ["zzz", "web", "code"]),
    "until_step < 0": lambda s: s["config"]["history"][0].__setitem__("until_step", -1),
    "step -5": lambda s: s.__setitem__("step", -5),
    "step 2^62": lambda s: s.__setitem__("step", 2**62),
    "config a list": lambda s: s.__setitem__("config", []),
}


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.parametrize("case", sorted(HOSTILE_STATES))
def test_hostile_states_end_in_a_state_error(tmp_path, case, allow):
    """A state with a mixture history, damaged: a StateError saying what is wrong, never a raw
    TypeError/IndexError from deep inside, with or without allow_mixture_change."""
    from forge_grain.errors import StateError

    stores = three(tmp_path)
    first = Pipeline(config(stores), 0, 1, num_threads=0)
    changed = config(stores)
    changed.sources[0].weight = 0.2
    state = Pipeline(changed, 0, 1, num_threads=0, resume_from=first.state_at(5), allow_mixture_change=True).state_at(9)
    state = json.loads(json.dumps(state))
    assert state["config"]["history"]  # the change is recorded
    HOSTILE_STATES[case](state)
    with pytest.raises(StateError):
        p = Pipeline(changed, 0, 1, num_threads=0, resume_from=state, allow_mixture_change=allow)
        next(p.iterator(state))


def test_a_server_that_never_answers_is_an_error_within_the_deadline(tmp_path, monkeypatch):
    """It accepts the connection and the request, then says nothing: FORGE_GRAIN_REMOTE_DEADLINE
    bounds an object's attempts all together (a quarter of it each; the client's own timeouts
    do not reach every call), so the default of 120 s ends in an error within about two minutes."""
    import contextlib
    import socket
    import threading
    import time

    from s3server import KEYS

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held = []

    def accept_all():
        with contextlib.suppress(OSError):  # until the socket closes
            while True:
                held.append(silent.accept())

    threading.Thread(target=accept_all, daemon=True).start()
    monkeypatch.setenv("FORGE_GRAIN_REMOTE_DEADLINE", "2")
    options = {**KEYS, "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}", "skip_instance_cache": True,
               "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 600}}
    start = time.monotonic()
    # the first request asks for the manifest's size (a manifest makes it a forge-grain store)
    with pytest.raises(ValueError, match=r"s3://bucket/store/manifest.json: failed after \d attempts in 2 s: "
                                         r"TimeoutError: no answer within 0.5 s \(FORGE_GRAIN_REMOTE_DEADLINE=2 s"):
        TokenStore.open("s3://bucket/store", storage_options=options, object_cache=str(tmp_path / "objects"))
    assert time.monotonic() - start < 2.5
    silent.close()


def test_a_moved_document_boundary_in_an_index_is_caught(tmp_path):
    """`.idx.npy` with an interior boundary moved, counts and ends kept: the manifest records the
    index's checksum, so verify=True names it and the fingerprint differs from the original's."""
    path = store(tmp_path / "s", 150, 0)
    original = TokenStore.open(path).fingerprint
    manifest = json.loads((path / "manifest.json").read_text())
    assert all(len(s["index_sha256"]) == 64 for s in manifest["shards"])
    index = path / manifest["shards"][0]["index"]
    offsets = np.load(index)
    offsets[5] += 1
    np.save(index, offsets)
    with pytest.raises(ValueError, match=r"idx.npy: checksum mismatch; the document index was changed"):
        TokenStore.open(path, verify=True)
    for s in manifest["shards"]:  # a manifest re-checksummed to match: the fingerprint says it is other data
        s["index_sha256"] = hashlib.sha256((path / s["index"]).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert TokenStore.open(path, verify=True).fingerprint != original


PLAN = """
import json, sys
from forge_grain import DataConfig, Pipeline
cfg = DataConfig(sources=[dict(name="w", path=sys.argv[1], strategy="bestfit")], seq_len=64, global_batch_size=8,
                 plan_chunk_docs=2000)
p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=sys.argv[2], plan_workers=1)
print(json.dumps([p.num_steps, int(p.batch(7)["inputs"].sum())]))
"""


def test_processes_planning_one_store_cold_at_once_all_finish_alike(tmp_path):
    """Three processes plan the same chunked store into one cold cache: they take turns (a
    lock per plan), none finds the chunks pulled from under it, all get the same plan."""
    import subprocess
    import sys

    path = store(tmp_path / "s", 12_000, 1)
    procs = [subprocess.Popen([sys.executable, "-c", PLAN, str(path), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert len({out for out, _ in outs}) == 1


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and mount; skipped elsewhere)."""
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_plan_cache_on_a_full_disk_falls_back_to_memory(tmp_path, full_disk, caplog):
    from forge_grain import DataConfig

    path = store(tmp_path / "s", 12_000, 1)
    cfg = DataConfig(sources=[dict(name="w", path=str(path), strategy="bestfit")], seq_len=64, global_batch_size=8,
                     plan_chunk_docs=2000)
    with caplog.at_level("WARNING"):
        full = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=full_disk / "c", plan_workers=1)
    assert "keeping the plan in memory" in caplog.text
    roomy = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "c", plan_workers=1)
    assert full.num_steps == roomy.num_steps
    assert all(np.array_equal(full.batch(s)["inputs"], roomy.batch(s)["inputs"]) for s in (0, 5, 17))


GOOD_ROWS = [json.dumps({"text": f"document number {i} " * 20}) for i in range(30)]
BAD_ROWS = {
    "truncated line": (b'{"text": "cut', r"row 30: not a JSON value .* truncated or not JSON Lines"),
    "not UTF-8": (b'{"text": "\xff\xfe bad"}', r"(line 31 \(byte \d+\): |row 30: field 'text' holds )bytes that are not UTF-8"),
    "missing field": (b'{"body": "x"}', r"row 30: the text is null"),
    "null": (b'{"text": null}', r"row 30: the text is null"),
    "a number": (b'{"text": 7}', r"row 30: holds the int value '7', not text"),
    "a list": (b'{"text": ["a", "b"]}', r"row 30: holds a list of strings; pass --join-lists"),
    "a row that is a list": (b'["a", "b"]', r"row 30: a JSON list, not an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_of_a_local_file_is_named_by_file_and_row(tmp_path, case):
    """Streaming from local JSON Lines (and preparing them) names the file and row of the bad
    row, as the reader of files at URLs does, never a raw ArrowInvalid or UnicodeDecodeError."""
    from forge_grain import DataConfig, PrepareError, prepare

    line, match = BAD_ROWS[case]
    f = tmp_path / "part.jsonl"
    f.write_bytes("\n".join(GOOD_ROWS).encode() + b"\n" + line + b"\n")
    for src in (dict(hf_dataset=str(f)), dict(hf_dataset="json", hf_data_files=[str(f)])):  # by path, by builder
        cfg = DataConfig(sources=[dict(name="t", hf_streaming=True, **src)], seq_len=32, global_batch_size=2)
        with pytest.raises(PrepareError, match=f"{f}, {match}"):
            for _ in Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache").iterator():
                pass
    with pytest.raises(PrepareError, match=f"{f}, {match}"):
        prepare(f, tmp_path / "out", progress=False)


def test_broken_foreign_indices_say_what_they_are(tmp_path):
    """An empty Megatron .idx, an empty LitData/MDS index.json, a LitData offset table with an
    item ending before it starts (0xFFFFFFFF then a small offset): each named for what it is."""
    import shutil
    from pathlib import Path

    (tmp_path / "meg").mkdir()
    (tmp_path / "meg" / "data.idx").write_bytes(b"")
    (tmp_path / "meg" / "data.bin").write_bytes(b"\0" * 64)
    for p in (tmp_path / "meg" / "data", tmp_path / "meg" / "data.bin"):
        with pytest.raises(ValueError, match=r"data\.idx: a Megatron index without its header \(0 bytes, empty\)"):
            TokenStore.open(p)
    (tmp_path / "lit").mkdir()
    (tmp_path / "lit" / "index.json").write_text("")
    with pytest.raises(ValueError, match=r"index\.json: empty: the index of a LitData or MosaicML MDS dataset"):
        TokenStore.open(tmp_path / "lit")

    lit = Path(shutil.copytree(Path(__file__).parent / "data" / "litdata" / "dataset", tmp_path / "litdata"))
    chunk = sorted(lit.glob("chunk-*.bin"))[0]
    data = bytearray(chunk.read_bytes())
    table = np.frombuffer(bytes(data[:64]), "<u4").copy()
    table[3] = 0xFFFFFFFF  # item 1 claims to end past 4 GB; item 2 then ends before it starts
    data[:64] = table.tobytes()
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"item 2 ends at byte \d+, before it starts \(byte 4294967295\)"):
        TokenStore.open(lit)


def test_a_foreign_file_rewritten_outside_the_samples_is_caught_by_a_full_fingerprint_source(tmp_path):
    """The README's remedy for a rewrite that keeps every EOS and misses the sampled blocks:
    `fingerprint="full"` as a source key of a pipeline config; a resume onto the rewritten
    file is then refused."""
    from forge_grain import DataConfig
    from forge_grain.errors import StateError

    from forge_grain.stores import checks

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 900, rng.integers(50, 400)), 1) for _ in range(24_000)]
    flat = np.concatenate(docs).astype(np.uint16)  # ~10.8 MB: above the size the sampled fingerprint hashes whole
    flat.tofile(tmp_path / "data.bin")
    read = np.zeros(flat.nbytes, bool)  # the bytes the sampled fingerprint reads: blocks and probes
    for off in checks.sample_offsets(flat.nbytes):
        read[off : off + checks.SAMPLE_BLOCK_BYTES] = True
    for off in checks.probe_offsets(flat.nbytes):
        read[off : off + checks.PROBE_BYTES] = True
    src = dict(name="raw", path=str(tmp_path / "data.bin"), dtype="uint16", eos_id=1, fingerprint="full")
    cfg = DataConfig(sources=[src], seq_len=64, global_batch_size=8)
    state = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "c").state_at(3)
    sampled = DataConfig(sources=[{**src, "fingerprint": "sampled"}], seq_len=64, global_batch_size=8)
    before = Pipeline(sampled, 0, 1, num_threads=0, cache_dir=tmp_path / "c").fingerprint
    middle = len(flat) // 2 + 1000  # a token no block or probe reads, and not an EOS
    while flat[middle] == 1 or flat[middle + 1] == 1 or read[2 * middle : 2 * middle + 2].any():
        middle += 1
    flat[middle] = 2 if flat[middle] != 2 else 3
    flat.tofile(tmp_path / "data.bin")
    # one token unread by the samples: the sampled fingerprint's documented limit
    assert Pipeline(sampled, 0, 1, num_threads=0, cache_dir=tmp_path / "c").fingerprint == before
    with pytest.raises(StateError, match="the data is not what the state was saved with"):
        Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "c").iterator(state)


def test_a_litdata_index_may_only_name_its_own_chunks(tmp_path):
    import shutil
    from pathlib import Path

    lit = Path(shutil.copytree(Path(__file__).parent / "data" / "litdata" / "dataset", tmp_path / "litdata"))
    shutil.copytree(lit, tmp_path / "other")
    index = json.loads((lit / "index.json").read_text())
    index["chunks"][0]["filename"] = "../other/" + index["chunks"][0]["filename"]
    (lit / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json: lists '\.\./other/.*', a file outside the dataset's directory"):
        TokenStore.open(lit)


@pytest.mark.parametrize("case", ["int column", "no text field", "not Parquet", "a glob matching nothing"])
def test_streaming_parquet_and_globs_that_cannot_be_read_are_named(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from forge_grain import DataConfig, PrepareError

    f = tmp_path / "part.parquet"
    if case == "int column":
        pq.write_table(pa.table({"text": [1, 2, 3]}), f)
        match = r"part\.parquet: field 'text' must hold text \(strings\), not Value\('int64'\)"
    elif case == "no text field":
        pq.write_table(pa.table({"body": ["a", "b"]}), f)
        match = r"part\.parquet: no text field 'text'; the columns are \['body'\]"
    elif case == "not Parquet":
        f.write_text("hello")
        match = r"part\.parquet: cannot load \(ArrowInvalid: .*footer"
    else:
        f = tmp_path / "nothing-*.jsonl"
        match = r"nothing-\*\.jsonl: no text, JSONL or Parquet files found"
    cfg = DataConfig(sources=[dict(name="t", hf_dataset=str(f), hf_streaming=True)], seq_len=32, global_batch_size=2)
    with pytest.raises(PrepareError, match=match):
        Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
