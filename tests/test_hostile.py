"""Hostile input: manifests, indices, plans, states and paths that are wrong on purpose.

Every case ends in a clear error naming the file (or key) and the problem, or in correct data.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import config, make_texts, store, write_jsonl

from forge_grain import (
    DataConfig, PackingError, Pipeline, PrepareError, StoreError, TokenStore, pack, prepare, write_store,
)
from forge_grain.errors import StepError
from forge_grain.pipeline import history
from forge_grain.pipeline.pipeline import StateError

CLI = [sys.executable, "-m", "forge_grain"]


def edit_manifest(path, change):
    m = json.loads((path / "manifest.json").read_text())
    m = change(m) or m
    (path / "manifest.json").write_text(json.dumps(m))


# -- manifests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, match", [
    ("../outside.bin", r"shards\[0\]\.tokens must name a file inside the store directory"),
    ("/etc/hostname", r"shards\[0\]\.tokens must name a file inside the store directory"),
    ("", r"shards\[0\]\.tokens must name a file inside"),
])
def test_shard_paths_are_confined_to_the_store(store_copy, name, match):
    def change(m):
        m["shards"][0]["tokens"] = name

    edit_manifest(store_copy, change)
    with pytest.raises(StoreError, match=rf"manifest\.json: {match}"):
        TokenStore.open(store_copy)


def test_a_shard_listed_three_times_is_refused(store_copy):
    def change(m):
        m["shards"] = [m["shards"][0]] * 3
        m["num_documents"] = 3 * m["shards"][0]["num_documents"]
        m["num_tokens"] = 3 * m["shards"][0]["num_tokens"]

    edit_manifest(store_copy, change)
    with pytest.raises(StoreError, match=r"shards list \['shard-00000\.bin', 'shard-00000\.idx\.npy'\] more than once"):
        TokenStore.open(store_copy)


def test_a_shard_that_is_not_a_regular_file_is_refused_at_once(store_copy):
    (store_copy / "shard-00001.bin").unlink()
    os.symlink("/dev/zero", store_copy / "shard-00001.bin")
    with pytest.raises(StoreError, match=r"shard-00001\.bin: shard listed in .* is not a regular file"):
        TokenStore.open(store_copy, verify=True)  # would read /dev/zero for ever


@pytest.mark.parametrize("change, match", [
    (lambda m: [m], r"a manifest is a JSON object, not a list"),
    (lambda m: {**m, "extra": 1}, r"unknown key\(s\) \['extra'\]"),
    (lambda m: {k: v for k, v in m.items() if k != "dtype"}, r"lacks \['dtype'\]"),
    (lambda m: {**m, "dtype": "<f2"}, r"dtype is '<f2'; this forge-grain reads \['<u2', '<u4'\]"),
    (lambda m: {**m, "num_documents": "7"}, r"num_documents must be an integer >= 0, not '7'"),
    (lambda m: {**m, "num_tokens": m["num_tokens"] + 1}, r"num_tokens is \d+, but its shards add up to \d+"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "extra": 1}] + m["shards"][1:]}, r"shards\[0\] must have exactly"),
    (lambda m: {**m, "shards": "shard-00000.bin"}, r"shards must be a list"),
    (lambda m: {**m, "eos_id": 10**6}, r"eos_id 1000000 is not below vocab_size"),
    (lambda m: {**m, "tokenizer": None}, r"tokenizer must be a dict"),
    (lambda m: {**m, "compression": "none"}, r"compression applies to the arrayrecord layout only, not 'bin'"),
])
def test_malformed_manifests_name_the_key(store_copy, change, match):
    edit_manifest(store_copy, change)
    with pytest.raises(StoreError, match=rf"manifest\.json: .*{match}"):
        TokenStore.open(store_copy)


def test_an_index_that_is_a_pickle_is_refused(store_copy):
    np.save(store_copy / "shard-00000.idx.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(StoreError, match=r"shard-00000\.idx\.npy: document index missing or unreadable"):
        TokenStore.open(store_copy)


# -- ArrayRecord damage ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["lz4", 3, None])
def test_an_arrayrecord_manifest_with_an_unknown_compression_names_the_key(ar_copy, value):
    edit_manifest(ar_copy, lambda m: {**m, "compression": value})
    with pytest.raises(StoreError, match=r"manifest\.json: compression is .*; this forge-grain reads \['none', 'zstd'\]"):
        TokenStore.open(ar_copy)


def test_a_truncated_arrayrecord_shard_is_named_at_open(ar_copy):
    shard = ar_copy / "shard-00001.array_record"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(StoreError, match=r"shard-00001\.array_record: holds 0 records, but manifest\.json lists"):
        TokenStore.open(ar_copy)


def test_swapped_arrayrecord_shards_are_detected_at_open(ar_copy):
    a, b = ar_copy / "shard-00000.array_record", ar_copy / "shard-00001.array_record"
    tmp = ar_copy / "swap"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    with pytest.raises(StoreError, match=r"shard-00000\.array_record: (holds \d+ records|its records disagree)"):
        TokenStore.open(ar_copy)


# -- plans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["seg_len", "seg_start", "row_ptr", "plan.json seq_len"])
def test_an_edited_plan_is_rebuilt(tmp_path, what, caplog):
    src = store(tmp_path / "s", 300, 1)
    cache = tmp_path / "plans"
    clean = pack(src, 64, "bestfit", cache_dir=cache)
    expected = clean.get_batch(np.arange(clean.num_rows))
    (plan_dir,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    if what == "plan.json seq_len":
        meta = json.loads((plan_dir / "plan.json").read_text())
        meta["seq_len"] = 128
        (plan_dir / "plan.json").write_text(json.dumps(meta))
    else:
        arr = np.load(plan_dir / f"{what}.array")
        arr[len(arr) // 2] += 1
        with open(plan_dir / f"{what}.array", "wb") as f:
            np.save(f, arr)
    with caplog.at_level(logging.WARNING):
        again = pack(src, 64, "bestfit", cache_dir=cache)
    assert "rebuilding the packing plan" in caplog.text
    got = again.get_batch(np.arange(again.num_rows))
    assert got["inputs"].shape[1] == 64
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


# -- pipeline states ------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [True, "7", 7.9, None, [7]])
def test_state_steps_of_the_wrong_type_are_refused(stores, step):
    p = Pipeline(config(stores), 0, 1, num_threads=0)
    state = {**p.state_at(3), "step": step}
    with pytest.raises(StateError, match="state step must be an integer"):
        p.iterator(state)


@pytest.mark.parametrize("step", [2**55, 2**62, -1])
def test_state_steps_out_of_range_are_refused_even_with_unlimited_epochs(stores, step):
    p = Pipeline(config(stores, num_epochs=None), 0, 1, num_threads=0)
    with pytest.raises(StateError, match=rf"state step {step} is outside \[0, \d+\]"):
        p.iterator({**p.state_at(3), "step": step})
    with pytest.raises(IndexError):
        p.batch(2**55)


def test_a_tampered_config_summary_is_still_a_state_error(stores):
    p = Pipeline(config(stores), 0, 1, num_threads=0)
    with pytest.raises(StateError, match="state config must be the pipeline's summary"):
        p.iterator({**p.state_at(3), "fingerprint": "0" * 64, "config": "not a dict"})
    with pytest.raises(StateError, match="config does not match its fingerprint"):
        p.iterator({**p.state_at(3), "config": {**p.state_at(3)["config"], "seed": 8}})


def forged(state: dict, **fields) -> dict:
    """`state` with config fields replaced and its fingerprint made to match: what a user (or
    a tool) editing a state's JSON by hand can write."""
    c = {**state["config"], **fields}
    return {**state, "config": c, "fingerprint": history.digest(c)}


HOSTILE_STATES = {  # (the state from a real one at step 3, the resume's options, what the error names)
    "a string step": (lambda s: {**s, "step": "3"}, {}, r"state step must be an integer, not str '3'"),
    "step 2**62, batch size change": (lambda s: {**s, "step": 2**62}, {"allow_batch_size_change": True},
                                      r"state step 4611686018427387904 is outside"),
    "step 2**70, batch size change": (lambda s: {**s, "step": 2**70}, {"allow_batch_size_change": True},
                                      r"state step 1180591620717411303424 is outside"),
    "step 2**40": (lambda s: {**s, "step": 2**40}, {}, r"state step 1099511627776 is outside \[0, 1099511627775\]"),
    "all-zero weights": (lambda s: forged(s, schedule=[[0, [0, 0, 0]]]), {"allow_mixture_change": True},
                         r"config\.schedule must be .* some positive"),
    "an empty schedule": (lambda s: forged(s, schedule=[]), {"allow_mixture_change": True}, r"config\.schedule must"),
    "sources not a list": (lambda s: forged(s, sources="web"), {"allow_mixture_change": True},
                           r"config\.sources must be a list"),
    "skips of 2**63 steps": (lambda s: forged(s, skips=[{"at_step": 3, "steps": 2**63}]), {},
                             r"config\.skips skips more steps than any run has"),
    "a config that is a list": (lambda s: {**s, "config": [1], "fingerprint": history.digest([1])},
                                {"allow_mixture_change": True}, r"state config must be the pipeline's summary"),
    "a batch change after the step": (
        lambda s: forged(s, batch_history=[{"until_step": 50, "batches": [[0, 4]]}]), {},
        r"config\.batch_history records a change at step 50, after the state's own step 3"),
    "a mixture change after the step": (
        lambda s: forged(s, history=[{"until_step": 9, "sources": ["web"], "schedule": [[0, [1.0]]]}]),
        {}, r"config\.history records a change at step 9"),
    "a skip after the step": (lambda s: forged(s, skips=[{"at_step": 4, "steps": 1}]), {},
                              r"config\.skips records a change at step 4"),
    "an unknown summary key": (lambda s: forged(s, rows_per_step=4), {}, r"config\.rows_per_step is not a key"),
    "a float seq_len": (lambda s: forged(s, seq_len=64.0), {"allow_mixture_change": True},
                        r"config\.seq_len must be a positive integer"),
    "a fingerprint that is a number": (lambda s: {**s, "fingerprint": 7}, {}, r"state fingerprint must be a string"),
    "a seq_len of 2**40": (lambda s: forged(s, seq_len=2**40), {"allow_mixture_change": True},
                           r"(sequence length differs from the state's|differing: \['seq_len'\])"),
    "a length history of 2**40": (
        lambda s: forged(s, seq_len_history=[{"until_step": 3, "seq_lens": [[0, 2**40]]}]),
        {"allow_seq_len_change": True}, r"sequence-length history is malformed"),
    "live weights that sum past a float": (
        lambda s: forged(s, live={"web": 1e308, "code": 1e308, "math": 0.0}), {}, r"config\.live must be the weights"),
    "a live weight that is a string": (lambda s: forged(s, live={"web": "1", "code": 1.0, "math": 0.0}), {},
                                       r"config\.live must be the weights"),
}


@pytest.mark.parametrize("name", list(HOSTILE_STATES))
def test_hostile_states_end_in_a_state_error_naming_the_field(stores, name):
    """Every field of a state is checked against what a real state can hold, before any of it
    is used: on a plain resume, with each allowance, and when an iterator restores it."""
    make, options, match = HOSTILE_STATES[name]
    p = Pipeline(config(stores, num_epochs=None), 0, 1, num_threads=0)
    state = make(p.state_at(3))
    with pytest.raises(StateError, match=match):
        Pipeline(config(stores, num_epochs=None), 0, 1, num_threads=0, resume_from=state, **options)
    with pytest.raises(StateError, match=match):
        p.iterator(state)


def test_a_forged_batch_history_never_trains_other_batch_sizes(stores):
    """A state whose (re-hashed) summary claims a batch change it cannot have made is refused,
    not resumed at 4 rows a step where the config says 8."""
    p = Pipeline(config(stores), 0, 1, num_threads=0)
    state = forged(p.state_at(3), batch_history=[{"until_step": 50, "batches": [[0, 4]]}])
    with pytest.raises(StateError, match="batch_history records a change at step 50"):
        Pipeline(config(stores), 0, 1, num_threads=0, resume_from=state)
    real = Pipeline(config(stores, global_batch_size=4), 0, 1, num_threads=0).state_at(3)
    resumed = Pipeline(config(stores), 0, 1, num_threads=0, resume_from=real, allow_batch_size_change=True)
    assert len(next(resumed.iterator(real))["inputs"]) == 8  # a real change: the config's size from the state on


@pytest.mark.parametrize("step", [2.5, np.float64(3.0), "3", True, -1, 10**6])
def test_steps_are_integers_inside_the_run_everywhere(stores, step):
    """Every method taking a step refuses one that is not an integer step of the run (a float
    once returned rows straddling two steps; a step past the end once answered)."""
    p = Pipeline(config(stores, num_epochs=1), 0, 1, num_threads=0)
    assert p.num_steps < 10**6
    for call in (p.batch, p.global_batch, p.batch_hash, p.explain, p.state_at, p.phase_at, p.consumed,
                 p.local_size):
        with pytest.raises(StepError, match=r"step must be an integer|outside this run's steps"):
            call(step)
    with pytest.raises(StepError):
        p.global_batch(p.num_steps)
    assert p.state_at(p.num_steps)["step"] == p.num_steps  # where a finished run's state stands


@pytest.fixture
def streaming_pipeline(tmp_path):
    data = write_jsonl(tmp_path / "web.jsonl", make_texts(300, seed=4))
    cfg = DataConfig.from_dict(dict(sources=[dict(name="web/en", hf_dataset="json", hf_data_files=str(data),
                                                  hf_streaming=True, window=50)],
                                    seq_len=32, global_batch_size=4, num_epochs=1))
    return Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("tamper", [
    lambda st: st["streams"][0]["0"].update(emitted=st["streams"][0]["0"]["emitted"] + 1),
    lambda st: st["streams"][0]["0"].pop("window"),
    lambda st: st.update(streams=[]),
    lambda st: st["streams"][0]["0"].update(row_index=-5),
    lambda st: st["streams"][0].update({"7": st["streams"][0]["0"]}),  # a stream the layout does not have
])
def test_a_tampered_streaming_state_is_refused(streaming_pipeline, tamper):
    it = streaming_pipeline.iterator()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    tamper(state)
    with pytest.raises(StateError, match="streams"):
        streaming_pipeline.iterator(state)


def test_source_names_with_slashes_stay_inside_the_cache(streaming_pipeline, tmp_path):
    next(iter(streaming_pipeline))  # the counting pass and the lock file of "web/en"
    root = tmp_path / "cache" / "hf"
    assert all(p.parent == root for p in root.iterdir()) and not (root / "web").exists()


def test_an_eager_source_named_like_a_path_is_cached_inside_the_root(tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", make_texts(40, seed=2))
    cfg = DataConfig.from_dict(dict(sources=[dict(name="../../escape", hf_dataset="json", hf_data_files=str(data))],
                                    seq_len=16, global_batch_size=2))
    Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    assert not list(tmp_path.glob("escape*")) and any((tmp_path / "cache" / "hf").glob("_.._escape-*"))


# -- empty shards ---------------------------------------------------------------------------------


def test_a_shard_of_only_empty_documents_gathers(tmp_path, reference_tokenizer):
    texts = ["   ", "", "\n"] * 4 + make_texts(12, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", texts)
    s = TokenStore.open(prepare(src, tmp_path / "s", num_shards=2, progress=False), verify=True)
    assert s.manifest.shards[0].num_documents == 0
    for strategy in ("concat", "bos_bestfit", "bestfit"):
        ds = pack(s, 16, strategy, cache_dir=tmp_path / "plans")
        assert ds.get_batch(np.arange(ds.num_rows))["inputs"].shape == (ds.num_rows, 16)


@pytest.mark.parametrize("seed", range(8))
def test_random_multi_shard_stores_with_empty_shards_gather_exactly(tmp_path, seed):
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, 100, rng.integers(1, 30)), 1).astype(np.uint16) for _ in range(40)]
    cuts = np.sort(rng.integers(0, len(docs) + 1, rng.integers(1, 6)))
    parts = np.split(np.arange(len(docs)), cuts)
    for k, part in enumerate(parts):  # some parts are empty: 0-byte files
        (np.concatenate([docs[i] for i in part]) if len(part) else np.zeros(0, np.uint16)).tofile(tmp_path / f"p{k:02d}.bin")
    s = TokenStore.open(tmp_path, dtype="uint16", eos_id=1)
    assert [s[i].tolist() for i in range(len(s))] == [d.tolist() for d in docs]
    one = TokenStore.open(write_store(tmp_path / "one", docs, vocab_size=100, eos_id=1))  # the same, one shard
    for strategy in ("concat", "bestfit"):
        a, b = (pack(x, 8, strategy, cache_dir=tmp_path / "plans" / x.path.name) for x in (s, one))
        rows = np.arange(a.num_rows)
        assert a.num_rows == b.num_rows
        assert all(np.array_equal(v, b.get_batch(rows)[k]) for k, v in a.get_batch(rows).items())


# -- prepare's smaller cases ----------------------------------------------------------------------


def test_num_shards_zero_is_an_error(corpus, tmp_path):
    with pytest.raises(PrepareError, match="num_shards must be a positive integer, not 0"):
        prepare(corpus, tmp_path / "s", num_shards=0, progress=False)


def test_an_existing_file_as_output_is_an_error_without_a_traceback(corpus, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    r = subprocess.run([*CLI, "prepare", str(corpus), str(tmp_path / "out"), "-q"], capture_output=True, text=True)
    assert r.returncode == 2 and "out: exists and is not a directory" in r.stderr and "Traceback" not in r.stderr


def test_an_output_inside_the_input_directory_is_not_read_as_input(tmp_path, texts):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "corpus.jsonl", texts)
    first = TokenStore.open(prepare(d, d / "store", num_shards=2, progress=False))
    again = TokenStore.open(prepare(d, d / "store", num_shards=2, progress=False))  # a no-op, not "other inputs"
    assert len(first) == len(again) == 392


def test_the_same_input_spelled_two_ways_is_one_input(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(corpus.parent)
    out = prepare(f"./{corpus.name}", tmp_path / "s", num_shards=2, progress=False)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    prepare(corpus.resolve(), out, num_shards=2, progress=False)
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def test_the_differing_setting_is_named(tmp_path, corpus):
    out = prepare(corpus, tmp_path / "s", num_shards=2, progress=False)
    with pytest.raises(PrepareError, match=r"differing: eos.*--overwrite"):
        prepare(corpus, out, num_shards=2, add_eos=False, progress=False)


def test_a_typo_in_a_local_path_says_the_path_does_not_exist(tmp_path):
    with pytest.raises(PrepareError, match=r"corpsu\.jsonl: no such file or directory"):
        prepare(tmp_path / "corpsu.jsonl", tmp_path / "s", progress=False)


def test_piping_into_head_gives_no_traceback(bin_store):
    r = subprocess.run(f"{sys.executable} -m forge_grain inspect {bin_store} --seq-len 64 | head -1",
                       shell=True, capture_output=True, text=True)
    assert r.stdout.strip() and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_an_iterator_alive_at_exit_prints_nothing(stores):
    code = (
        "import sys; sys.path.insert(0, 'tests'); from conftest import config; from forge_grain import Pipeline; "
        f"s = {json.dumps({k: str(v) for k, v in stores.items()})}; "
        "it = iter(Pipeline(config(s), 0, 1, num_threads=2)); next(it)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "is_finalizing" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_a_no_bos_store_records_no_bos_and_bos_bestfit_refuses_it(corpus, tmp_path):
    s = TokenStore.open(prepare(corpus, tmp_path / "s", add_bos=False, progress=False))
    assert s.bos_id is None and s.eos_id == 1 and all(s[i][0] != 0 for i in range(len(s)) if len(s[i]))
    with pytest.raises(PackingError, match="BOS"):
        pack(s, 64, "bos_bestfit")


def test_progress_moves_per_batch_with_worker_processes(tmp_path, monkeypatch):
    from forge_grain.preparation import local as preparation

    calls = []
    real = preparation._Progress.update
    monkeypatch.setattr(preparation._Progress, "update", lambda self, item: (calls.append(item), real(self, item)))
    src = write_jsonl(tmp_path / "c.jsonl", make_texts(4096, seed=1))
    prepare(src, tmp_path / "s", num_shards=2, num_proc=2, progress=False)
    assert len(calls) >= 8 and sum(docs for docs, _ in calls) == 4096  # batches of 512 rows, not 2 shards


def test_a_resume_with_only_the_seed_changed_names_only_the_seed(stores):
    """(The sources' plans follow from the seed: listing 'sources' too sent users looking for a
    change of data that was not there.)"""
    state = Pipeline(config(stores), 0, 1, num_threads=0).state_at(3)
    with pytest.raises(StateError, match=r"differing: \['seed'\]\."):
        Pipeline(config(stores, seed=8), 0, 1, num_threads=0).iterator(state)
    with pytest.raises(StateError, match=r"differing: \['seq_len'\]\."):
        Pipeline(config(stores, seq_len=32), 0, 1, num_threads=0).iterator(state)


# -- huge or malformed values: the project's error naming the field ------------------------------


@pytest.mark.parametrize("fields, match", [
    (dict(seq_len=10**9), r"seq_len: 1,000,000,000 is past 16,777,216"),
    (dict(seq_len=2**31, seq_lens=[[0, 64], [5, 2**31]], num_epochs=None, max_steps=10), r"seq_len: "),
    (dict(seq_len=64, seq_lens=[[0, 2**40], [5, 64]], num_epochs=None, max_steps=10),
     r"seq_lens\[0\] is \[0, 1099511627776\]: a length past 16,777,216"),
    (dict(global_batch_size=2**40), r"global_batch_size: 1,099,511,627,776 is past"),
    (dict(batch_sizes=[[0, 8], [3, 2**40]]), r"batch_sizes\[1\] .*a batch size past"),
])
def test_huge_lengths_and_batch_sizes_are_config_errors(stores, fields, match):
    """`seq_lens` of 2**40, 10**9 or 2**31 ended in a raw MemoryError."""
    from forge_grain import ConfigError

    with pytest.raises(ConfigError, match=match):
        Pipeline(config(stores, **fields), 0, 1, num_threads=0)


@pytest.mark.parametrize("weights, match", [
    ({"web": 1e308, "code": 1e308, "math": 0.0}, r"set_weights: the weights sum past the largest float"),
    ({"web": "1", "code": 1.0}, r"set_weights: the weight of 'web': must be a finite number >= 0, got '1'"),
    ({"web": True, "code": 1.0}, r"the weight of 'web': must be a finite number"),
    ({"web": float("nan"), "code": 1.0}, r"the weight of 'web': must be a finite number"),
])
def test_set_weights_takes_what_a_config_file_takes(stores, weights, match):
    """One rule for weights everywhere: 1e308 + 1e308 overflowed into a raw "all zero" ValueError,
    and a string weight passed `set_weights` though config files and states refuse it."""
    from forge_grain import ConfigError

    p = Pipeline(config(stores), 0, 1, num_threads=0)
    with pytest.raises(ConfigError, match=match):
        p.with_weights(weights, 4)
    with pytest.raises(ConfigError, match=r"sources: the weights sum past the largest float"):
        Pipeline(config(stores, sources=[dict(s, weight=1e308) for s in config(stores).to_dict()["sources"]]), 0, 1,
                 num_threads=0)


@pytest.mark.parametrize("step", [-1, 10**30, "3", 2.5])
def test_global_and_shard_rows_take_steps_like_every_method(stores, step):
    """`global_rows(2.5)` returned rows straddling steps 2 and 3; -1, 10**30 and '3' raised raw errors."""
    p = Pipeline(config(stores), 0, 2, num_threads=0)
    with pytest.raises(StepError):
        p.global_rows(step)
    with pytest.raises(StepError):
        p.shard_rows(step)
