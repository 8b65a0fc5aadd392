"""Every feature crossed with every other: the covering set of tests/crossings.py, run whole
with FORGE_GRAIN_SLOW=1 and as a seeded subset by default.

Each case runs as a user's training would: in child processes (tests/crossing_run.py), over
its store at its location, with its run shape, consumer and interruption, each process under
a deadline (a hang fails the case), and no process it started may outlive it. The oracle is
the same for every case: each rank's batches equal its slice of the reference run, the
uninterrupted single-process iterator over the local copy of the data (made in this process);
the flight recorder's commands, run over the training run's state, give those batches, their
hashes, their documents and their token count. A case holding a refused pair (crossings.REFUSED,
the table docs/failures.md includes) must end in that error.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, make_texts, write_jsonl

import crossings
from crossing_run import run_legs

pytest.importorskip("s3fs")
pytest.importorskip("moto")
from s3server import KEYS, Peak, S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# steps trained (the run has 4 more: skips shorten it); where a resume shape changes the run; the
# odd step of an interruption
STEPS, RESUME, BREAK = 10, 4, 5
# the most bytes of the tested dataset's token files a case under a cache_limit may fetch, over
# the data's, all its processes and tools sharing one cache (one host): its steps read the first
# windows of the order fitted to the cache (a length change inside an epoch read every file at
# every step: 27x for a Megatron file over an epoch; each tool in a cache of its own, up to 4x);
# a Megatron or raw file up to 64 MiB is also read whole once at its first open, its checks and
# fingerprint taken from memory, before the epoch fetches its blocks
FETCHED_AT_MOST = 1.5
RECORDS = 16384  # bytes of a cache_limit for the records beside the data (what the first open found, the ledger)
READ_WHOLE_AT_OPEN = ("megatron", "raw_bin", "raw_npy")
DEADLINE_S = 300  # one process of a case
CASES = crossings.covering()


@pytest.fixture(scope="module")
def s3():
    with S3Server("cross") as server:
        yield server


@pytest.fixture(scope="module")
def data(tmp_path_factory, s3):
    """Every kind of data, on disk and in s3://cross/<kind>; the aux stores mixed beside them."""
    from mds_writer import write_mds
    from test_formats import LITDATA, make_docs, write_arrow, write_megatron

    from forge_grain import prepare, write_store

    base = tmp_path_factory.mktemp("crossings")
    texts = make_texts(200, seed=21, empty_every=41)
    corpus = write_jsonl(base / "corpus.jsonl", texts)
    docs = make_docs(160, seed=23)
    local = {
        "bin": prepare(write_jsonl(base / "bin.jsonl", make_texts(800, seed=26, empty_every=41)), base / "bin",
                       num_shards=4, progress=False),  # (two of its shards and the records are below its size)
        "arrayrecord": prepare(corpus, base / "ar", layout="arrayrecord", num_shards=4, progress=False),
        "aux_text": prepare(write_jsonl(base / "aux.jsonl", make_texts(120, seed=22)), base / "aux_text", num_shards=1,
                            progress=False),
        "aux_ids": write_store(base / "aux_ids", make_docs(100, seed=24), vocab_size=1000, eos_id=1),
        "litdata": LITDATA / "dataset",
        "mds": write_mds(base / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], samples_per_shard=40),
        "mds_zstd": write_mds(base / "mds_zstd", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs * 3],
                              samples_per_shard=60, compression="zstd"),  # (8 shards: two with their copies fit below it)
        "arrow": write_arrow(base / "arrow", docs, num_shards=4),
    }
    rng = np.random.default_rng(25)
    masks = [rng.random(len(d)) < 0.6 for d in docs]  # loss masks from the data
    local["masked"] = write_store(base / "masked", docs, vocab_size=1000, eos_id=1, masks=masks)
    (base / "olmo").mkdir()
    np.concatenate(docs).astype(np.uint16).tofile(base / "olmo" / "token_ids_part_0000.npy")
    np.concatenate(masks).tofile(base / "olmo" / "labels_mask_part_0000.npy")
    local["olmo_masks"] = base / "olmo"
    (base / "meg").mkdir()
    local["megatron"] = write_megatron(base / "meg" / "text_document", docs).parent
    for kind, suffix in (("raw_bin", "bin"), ("raw_npy", "npy")):
        (base / kind).mkdir()
        flat = np.concatenate(docs * 3).astype(np.uint16)  # (half of it and the records are below its size)
        flat.tofile(base / kind / "part-0.bin") if suffix == "bin" else np.save(base / kind / "part-0.npy", flat)
        local[kind] = base / kind
    halves = [write_jsonl(base / f"s{k}.jsonl", texts[k * 100:(k + 1) * 100]) for k in range(2)]
    hub = base / "hub" / "data"
    hub.mkdir(parents=True)
    for k, f in enumerate(halves):
        shutil.copy(f, hub / f"train-{k:05d}-of-00002.jsonl")
    fs = s3.fs()
    for kind, path in local.items():
        fs.put(str(path), f"cross/{kind}", recursive=True)
    for f in halves:
        fs.put(str(f), f"cross/texts/{f.name}")
    return {"local": local, "files": [str(f) for f in halves], "hub": str(base / "hub"), "base": base,
            "limits": {kind: cache_limit(kind, Path(path)) for kind, path in local.items()}}


def cache_limit(kind: str, path: Path) -> int:
    """A cache_limit below the dataset's size that holds two of its files (half of a
    single-file dataset: it is then read in blocks), and the records beside them: the order is
    fitted to it, and the cache evicts. (Three files and 64 KiB of records held these small
    datasets whole: the order of most kinds was not fitted, and nothing was evicted.) Compressed
    MDS shards are decompressed into the cache beside their compressed copy: two of them with
    their copies, and the records of its eight shards (about 3.7 KB each), below the decompressed
    data (the limit was once above it). Its shards are three times the others' documents: with
    shards of 20 documents the records outweighed them, and an elastic run (up to four ranks of
    two DataLoader workers) sharing the cache fetched up to 3.8x the data."""
    files = [f.stat().st_size for f in data_files(path)]
    if kind == "mds_zstd":
        shards = json.loads((path / "index.json").read_text())["shards"]
        return 2 * max((path / s["zip_data"]["basename"]).stat().st_size + s["raw_data"]["bytes"] for s in shards) + 2 * RECORDS
    return (files[0] // 2 if len(files) == 1 else 2 * max(files)) + RECORDS


NOT_TOKENS = (".json", ".idx", ".idx.npy")  # a dataset's indices and manifests


def data_files(path: Path) -> list[Path]:
    """A dataset's files of tokens (not its indices and manifests)."""
    return [f for f in path.rglob("*") if f.is_file() and not f.name.endswith(NOT_TOKENS)]


def fetched(s3, kind: str) -> int:
    """Bytes of the dataset `kind`'s token files the server sent through the counting proxy."""
    return sum(n for p, n in s3.proxy.sent.items() if f"/cross/{kind}/" in p and not p.endswith(NOT_TOKENS))


FOREIGN = {"megatron": {}, "raw_bin": {"dtype": "uint16", "eos_id": 1}, "raw_npy": {"eos_id": 1}, "litdata": {},
           "mds": {}, "mds_zstd": {}, "arrow": {}, "masked": {},
           "olmo_masks": {"dtype": "uint16", "eos_id": 1, "file_pattern": "token_ids_*.npy",
                          "label_masks": "labels_mask_*.npy"}}


def source(data, case: dict, s3, local: bool = False) -> dict:
    """The source under test ("t") of a case; `local`: its copy on disk (the reference's)."""
    kind = case["store"]
    where = "local" if local else case["location"]
    remote = {}
    if where != "local":
        proxied = s3.options(via_proxy=where == "s3_limit")  # (under a limit the bytes served are counted)
        options = proxied if case["credentials"] == "explicit" else {
            k: v for k, v in proxied.items() if k not in ("key", "secret")}
        remote = {"storage_options": options}
    if kind in crossings.STREAMING:
        stream = dict(name="t", hf_streaming=True, window=20, strategy="bestfit")
        if kind == "stream_hub":
            return dict(stream, hf_dataset=data["hub"])
        files = data["files"] if where == "local" else [f"s3://cross/texts/{Path(f).name}" for f in data["files"]]
        return dict(stream, hf_dataset="json", hf_data_files=files, **remote)
    path = str(data["local"][kind]) if where == "local" else f"s3://cross/{kind}"
    out = dict(name="t", path=path, strategy="bestfit", **remote)
    if kind in FOREIGN:
        out.update(FOREIGN[kind], vocab_size=1000)
    if where == "s3_limit":
        out["cache_limit"] = data["limits"][kind]
    elif case["location"] == "s3_limit":  # the reference reads its local copy in the order fitted to that cache
        out["shuffle_bytes"] = data["limits"][kind] // 4
    if where != "local":
        out["object_cache"] = str(data["base"] / "objects" / crossings.case_id(case))  # (one host: its runs and tools)
    return out


def config(data, case, s3, local=False, weights=(0.7, 0.3)) -> dict:
    """The case's mixture: the source under test and an aux store, which is in object storage
    too where the case's location is "s3" (two sources there: opened at once, and a fresh
    step's read from both at once), on disk otherwise (one of each)."""
    aux = "aux_ids" if case["store"] in FOREIGN else "aux_text"
    t = dict(source(data, case, s3, local), weight=weights[0])
    a = dict(name="aux", path=str(data["local"][aux]), weight=weights[1], strategy="concat")
    if case["location"] == "s3" and not local:
        a.update(path=f"s3://cross/{aux}", storage_options=t.get("storage_options") or s3.options(),
                 object_cache=str(data["base"] / "objects" / f"{crossings.case_id(case)}-aux"))
    d = dict(sources=[t, a],
             seq_len=32, global_batch_size=8, seed=5, num_epochs=None, max_steps=STEPS + 4, canonical_streams=4,
             canonical_workers=2)
    shape = case["shape"]
    if shape == "phases":
        d["phases"] = [{"start_step": 3, "weights": {"t": 0.3, "aux": 0.7}}]
    elif shape == "batch_sizes":
        d["batch_sizes"] = [[0, 4], [5, 8]]
    elif shape == "seq_lens":
        d["seq_lens"] = [[0, 16], [6, 32]]
    return d


def legs(data, case, s3, local=False) -> list[dict]:
    """The run shape as legs: (start, stop, shards, config, resume options, live changes)."""
    c = config(data, case, s3, local)
    leg = lambda start, stop, **kw: dict(start=start, stop=stop, world=kw.pop("world", 1), config=kw.pop("config", c),
                                         **kw)
    shape = case["shape"]
    if shape == "set_weights":
        return [leg(0, STEPS, live=[(6, {"t": 0.2, "aux": 0.8})])]
    if shape == "skip_steps":
        return [leg(0, RESUME), leg(RESUME, STEPS, resume={"skip_steps": 2})]
    if shape == "skip_documents":
        return [leg(0, RESUME), leg(RESUME, STEPS, resume={"skip_documents": {"t": [3, 10]}})]
    if shape == "mixture_change":
        return [leg(0, RESUME), leg(RESUME, STEPS, config=config(data, case, s3, local, (0.4, 0.6)),
                                    resume={"allow_mixture_change": True})]
    if shape == "elastic":
        return [leg(0, 3), leg(3, 6, world=2), leg(6, STEPS, world=4)]
    return [leg(0, STEPS)]


def split(all_legs: list[dict], at: int) -> tuple[list[dict], list[dict]]:
    """The legs before step `at` and from it (the leg holding it cut in two; its second part
    resumes plainly, its resume options having been applied at its start)."""
    before, after = [], []
    for leg in all_legs:
        if leg["stop"] <= at:
            before.append(leg)
        elif leg["start"] >= at:
            after.append(leg)
        else:
            before.append(dict(leg, stop=at))
            after.append(dict(leg, start=at, first=False))
    return before, after


# -- the reference ----------------------------------------------------------------------------

_REFERENCE: dict = {}


def reference(data, case, s3, tmp_path) -> dict[int, dict]:
    """Global batch of every step: the case's legs on one shard, in this process, over the data
    on disk (elastic legs are one run: the global batch does not depend on the shard count)."""
    key = (case["store"], case["shape"], case["location"] == "s3_limit")  # (there: the order fitted to the cache)
    if key not in _REFERENCE:
        run = [dict(leg, world=1) for leg in legs(data, case, s3, local=True)]
        if case["shape"] == "elastic":
            run = [dict(run[0], stop=STEPS)]
        run[-1]["stop"] = None  # to the run's end
        out = {}
        run_legs({"legs": run, "consumer": "reference", "cache_dir": str(tmp_path / "ref-cache")},
                 lambda step, rank, world, arrays: out.__setitem__(step, {k: np.array(v) for k, v in arrays.items()}))
        assert sorted(out) == list(range(len(out))) and len(out) >= STEPS
        _REFERENCE[key] = out
    return _REFERENCE[key]


# -- running a case's processes -----------------------------------------------------------------


def run_child(spec: dict, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    """One process of the case, under the deadline; then no process it started may remain."""
    spec_file = tmp_path / f"spec-{uuid.uuid4().hex[:6]}.json"
    spec_file.write_text(json.dumps(spec))
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "crossing_run.py"), str(spec_file)],
                            env={**env, "FORGE_CROSSING": marker}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the process did not end within {DEADLINE_S} s (a hang):\n{err[-3000:]}")
    left = survivors(marker)
    assert not left, f"processes outlived their parent: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def survivors(marker: str, wait_s: float = 20.0) -> list[str]:
    """The processes still running with `marker` in their environment, after waiting for them
    to go; those left are killed (and named)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if f"FORGE_CROSSING={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                        found.append(pid)
                except OSError:
                    pass
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    return found


def child_env(case) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_ACCESS_KEY", "AWS_SECRET", "AWS_SESSION"))}
    if case["location"] != "local" and case["credentials"] == "environment":
        env.update(AWS_ACCESS_KEY_ID=KEYS["key"], AWS_SECRET_ACCESS_KEY=KEYS["secret"])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def train(data, case, s3, tmp_path, consumer: str, save_at: int | None = None) -> tuple[list, Path]:
    """The case's training processes (its interruption between them); the records of every
    batch seen, and the file of the state the run ended with. `save_at`: also keep the state
    at that step (a leg boundary made there), in `state-<step>`."""
    run, env = legs(data, case, s3), child_env(case)
    records, final = tmp_path / "records.pkl", tmp_path / "state.pkl"
    base = {"consumer": consumer, "cache_dir": str(tmp_path / "cache"), "work_dir": str(tmp_path / "work"),
            "records": str(records)}
    if save_at is not None and not any(leg["start"] == save_at for leg in run):
        run = split(run, save_at)[0] + split(run, save_at)[1]
    if case["interruption"] == "none":
        parts = [(run, None)]
    else:
        head, tail = split(run, BREAK)
        parts = [(head, case["interruption"]), (tail, None)]
    state_in = None
    for k, (part, how) in enumerate(parts):
        state_out = tmp_path / f"state-{k}.pkl"
        spec = dict(base, legs=_saving(part, save_at, tmp_path), state_out=str(state_out), state_in_file=state_in,
                    kill_after=2 if how == "sigkill" else None)
        r = run_child(spec, tmp_path, env)
        if r.returncode != (-signal.SIGKILL if how == "sigkill" else 0):  # (a killed one must have been killed)
            return [("error", r.stderr or f"exit status {r.returncode}")], final
        state_in = str(state_out)
    shutil.copy(state_in, final)
    return read_records(records), final


def _saving(part: list[dict], save_at, tmp_path) -> list[dict]:
    return [dict(leg, save_state_to=str(tmp_path / f"state-at-{leg['stop']}.pkl")) if leg["stop"] == save_at else leg
            for leg in part]


def read_records(path: Path) -> list:
    out = []
    with open(path, "rb") as f:
        while True:
            try:
                out.append(pickle.load(f))
            except EOFError:
                return out


def check_records(records: list, want: dict, run: list[dict]) -> None:
    """Every batch seen is its rank's slice of the reference; every step of every leg was seen
    on each of the leg's ranks."""
    assert records and records[0][0] != "error", records[0][1][-3000:] if records else "no batch"
    seen = set()
    for step, rank, world, arrays in records:
        ref = want[step]
        n = len(ref["inputs"]) // world
        for key, a in arrays.items():
            assert np.array_equal(np.asarray(a), ref[key][rank * n:(rank + 1) * n]), (step, rank, world, key)
        seen.add((step, rank, world))
    needed = {(s, r, leg["world"]) for leg in run for s in range(leg["start"], leg["stop"]) for r in range(leg["world"])}
    assert needed <= seen, sorted(needed - seen)[:5]


# -- the flight recorder's commands over the run's state ----------------------------------------


def write_config_toml(d: dict, path: Path) -> Path:
    """A config dict as TOML (what the commands read)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items() if x is not None) + " }"
        raise TypeError(v)

    d = dict(d, num_epochs=float("inf") if d.get("num_epochs") is None else d["num_epochs"])  # (TOML has no None)
    lines = [f"{k} = {'inf' if v == float('inf') else value(v)}" for k, v in d.items()
             if k not in ("sources", "phases") and v is not None]
    for table in ("sources", "phases"):
        for entry in d.get(table, []):
            lines += ["", f"[[{table}]]"] + [f"{k} = {value(v)}" for k, v in entry.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def command(args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    marker = uuid.uuid4().hex
    r = subprocess.run([sys.executable, "-m", "forge_grain", *args], env={**env, "FORGE_CROSSING": marker},
                       capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)
    assert not survivors(marker)
    return r


def check_tool(tool: str, data, case, s3, tmp_path, want: dict) -> None:
    """Train with the iterator, then run `tool` over the last leg's config and a state of the run:
    for stored sources the final state and every step; for streaming ones (whose rows are
    known once read) the state at step 5 and the steps from it."""
    streaming = case["store"] in crossings.STREAMING
    records, final = train(data, case, s3, tmp_path, "iter0", save_at=BREAK if streaming else None)
    check_records(records, want, legs(data, case, s3))
    run, env = legs(data, case, s3), child_env(case)
    toml = write_config_toml(run[-1]["config"], tmp_path / "run.toml")
    state_file = tmp_path / f"state-at-{BREAK}.pkl" if streaming else final
    state = pickle.loads(Path(state_file).read_bytes())["global"]
    (tmp_path / "state.json").write_text(json.dumps(state))
    steps = range(BREAK if streaming else 0, STEPS)
    common = ["--state", str(tmp_path / "state.json")]
    if tool == "hashes":
        from forge_grain.pipeline.explain import hash_batch

        r = command(["hashes", str(toml), "--steps", f"{steps.start}:{steps.stop}", *common], env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        got = dict(line.split() for line in r.stdout.split("\n") if line.strip())
        assert got == {str(s): hash_batch(want[s]) for s in steps}
    elif tool == "replay":
        r = command(["replay", str(toml), "--steps", f"{steps.start}:{steps.stop}", "--out", "r.npz", *common],
                    env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        got = np.load(tmp_path / "r.npz")
        rows = got["rows_per_step"] if "rows_per_step" in got else [len(want[s]["inputs"]) for s in steps]
        at = 0
        for s, n in zip(steps, rows):
            for key in ("inputs", "targets", "loss_mask"):
                w = want[s][key]
                if "seq_len_per_step" in got:
                    part = got[key][at:at + w.size].reshape(w.shape)
                elif "rows_per_step" in got:
                    part = got[key][at:at + n]
                else:
                    part = got[key][s - steps.start]
                assert np.array_equal(part, w), (s, key)
            at += want[s]["inputs"].size if "seq_len_per_step" in got else n
    elif tool == "explain":
        from forge_grain import TokenStore

        for s in (steps.start, steps.stop - 1):
            r = command(["explain", str(toml), "--step", str(s), "--json", *common], env, tmp_path)
            assert r.returncode == 0, r.stderr[-3000:]
            rows = json.loads(r.stdout)
            assert len(rows) == len(want[s]["inputs"])
            for row in rows:
                src = next(x for x in config(data, case, s3, local=True)["sources"] if x["name"] == row["source"])
                for seg in row["segments"] if "path" in src and row["segments"] else []:  # (streamed: no index)
                    store = TokenStore.open(src["path"], **{k: v for k, v in src.items() if k in (
                        "dtype", "eos_id", "vocab_size", "file_pattern", "label_masks")})
                    a, b = seg["slots"]
                    lo, hi = seg["tokens"]
                    assert np.array_equal(want[s]["inputs"][row["row"], a:b], store[seg["document"]][lo:hi]), (s, row)
                    if store.masked:  # the runs explain names are the data's targets
                        marked = np.zeros(hi - lo, bool)
                        for x, y in seg["targets"]:
                            marked[x - lo:y - lo] = True
                        assert np.array_equal(marked, store.target_mask(seg["document"])[lo:hi]), (s, row)
    elif tool == "plan":
        r = command(["plan", str(toml), "--json", *common], env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        d = json.loads(r.stdout)
        assert d["steps"] == len(want) and d["tokens"] == sum(w["inputs"].size for w in want.values())


def cache_peak(data, case, s3):
    """A poll of the bounded cache a case under a cache_limit reads through (None for others)."""
    src = source(data, case, s3)
    if "cache_limit" not in src:
        return None
    from forge_grain.stores.object_cache import ObjectCache

    return Peak(ObjectCache(src["path"], s3.options(via_proxy=True), src["object_cache"], limit=src["cache_limit"]))


# -- the test -----------------------------------------------------------------------------------

CHOSEN = CASES if SLOW else crossings.default_subset(CASES)
TOOLS = ("explain", "replay", "hashes", "plan")


@pytest.mark.parametrize("case", CHOSEN, ids=crossings.case_id)
def test_a_crossing_gives_the_reference_batches_or_its_documented_refusal(data, s3, tmp_path, case):
    refused = crossings.refusal(case)
    if refused:
        records, _ = train(data, case, s3, tmp_path, "iter0" if case["consumer"] in TOOLS else case["consumer"])
        assert records and records[0][0] == "error", "the case ran; it is listed as refused"
        assert re.search(refused[0], records[0][1]), records[0][1][-3000:]
        return
    want = reference(data, case, s3, tmp_path)
    s3.proxy.clear()
    peak = cache_peak(data, case, s3)
    try:
        if case["consumer"] in TOOLS:
            check_tool(case["consumer"], data, case, s3, tmp_path, want)
        else:
            records, _ = train(data, case, s3, tmp_path, case["consumer"])
            check_records(records, want, legs(data, case, s3))
    finally:
        most = peak.stop() if peak else None
    if peak:  # the cache shared by all the case's processes, ledger included, never above its limit
        assert 0 < most <= data["limits"][case["store"]], (most, data["limits"][case["store"]])
    if case["location"] == "s3_limit":  # an order that fits the cache: its files fetched about once, whatever crosses it
        size = sum(f.stat().st_size for f in data_files(Path(data["local"][case["store"]])))
        most = (FETCHED_AT_MOST + (1 if case["store"] in READ_WHOLE_AT_OPEN else 0)) * size
        if case["interruption"] == "sigkill":  # what the killed process held or had in flight, fetched again
            most += data["limits"][case["store"]]
        assert fetched(s3, case["store"]) <= most, fetched(s3, case["store"]) / size


def test_the_printed_table_is_the_covering_set():
    """tests/crossings.md is what crossings.py prints (regenerate it after changing an axis),
    and every pair of any two axes' values is held by a case that runs, or is refused or absent."""
    assert (ROOT / "tests" / "crossings.md").read_text() == crossings.table(CASES)
    names = list(crossings.AXES)
    every = {((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1:]
             for x in crossings.AXES[a] for y in crossings.AXES[b]}
    ran = set().union(*[crossings.pairs_of(c) for c in CASES if not crossings.refusal(c)])
    assert every - ran == set(crossings.REFUSED) | set(crossings.ABSENT)


def test_the_failure_page_lists_every_refused_pair():
    page = (ROOT / "docs" / "failures.md").read_text()
    for (a, b), (_, why) in crossings.REFUSED.items():
        assert f"| {a[1]} × {b[1]} | {why} |" in page
