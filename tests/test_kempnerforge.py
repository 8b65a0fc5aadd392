"""KempnerForge job files load as they are, with KempnerForge's meaning."""

from __future__ import annotations

import json
from pathlib import Path
import warnings

import numpy as np
import pytest
import torch
from conftest import make_texts, write_jsonl

from forge_grain import ConfigError, DataConfig, Pipeline
from forge_grain.tokenizer import DEFAULT_TOKENIZER


def docs(seed, n=120, vocab=8000, eos=1):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(2, vocab, rng.integers(5, 90)), eos) for _ in range(n)]


def job(tmp_path, data: str, max_steps: int = 50) -> DataConfig:
    """A KempnerForge job file with other tables it carries (ignored here), read by from_toml."""
    (tmp_path / "job.toml").write_text(
        "[model]\ndim = 256\n\n[optimizer]\nlr = 3e-4\n\n"
        f"[data]\n{data}\n\n[train]\nseq_len = 64\nbatch_size = 2\ngrad_accum_steps = 2\nmax_steps = {max_steps}\n"
        "compile_model = false\n\n[distributed]\ndp_shard = 2\ntp = 1\n"
    )
    return DataConfig.from_toml(tmp_path / "job.toml")


def test_a_single_npy_directory_with_document_aware_packing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # KempnerForge takes relative paths from the working directory
    (tmp_path / "tok").mkdir()
    ds = docs(0)
    np.save(tmp_path / "tok" / "part_000.npy", np.concatenate(ds[:60]).astype(np.uint16))
    np.save(tmp_path / "tok" / "part_001.npy", np.concatenate(ds[60:]).astype(np.uint16))
    cfg = job(tmp_path, f'dataset_path = "tok"\ntokenizer_path = "{DEFAULT_TOKENIZER}"\npack_sequences = true')
    assert cfg.global_batch_size == 2 * 2 * 2 and cfg.seq_len == 64 and cfg.max_steps == 50
    (src,) = cfg.sources
    assert (src.name, src.strategy, src.eos_id, src.file_pattern) == ("tok", "concat", 1, "*.npy")
    p = Pipeline(cfg, 0, 1, num_threads=0)
    assert p.num_steps == 50 and [d.tolist() for d in p.stores[0]] == [d.tolist() for d in ds]
    batch = p.batch(0)
    assert batch["segment_ids"].max() > 1  # documents are separated within rows

    plain = job(tmp_path, f'dataset_path = "tok"\ntokenizer_path = "{DEFAULT_TOKENIZER}"')
    assert plain.sources[0].eos_id is None  # without pack_sequences: plain concatenation of each file
    assert len(Pipeline(plain, 0, 1, num_threads=0).stores[0]) == 2


def test_bin_files_take_uint32_from_a_tokenizer_of_more_than_65535_ids(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "big-tokenizer.json"))
    ds = docs(1, vocab=70_000, eos=70_000)
    (tmp_path / "data").mkdir()
    for k in range(3):
        np.concatenate(ds[k::3]).astype(np.uint32).tofile(tmp_path / "data" / f"tokenized_{k:04d}.bin")
    (tmp_path / "data" / "README.md").write_text("not data")
    cfg = job(tmp_path, f'dataset_path = "{tmp_path / "data"}"\nfile_pattern = "tokenized_*.bin"\n'
                        f'tokenizer_path = "{tmp_path / "big-tokenizer.json"}"\npack_sequences = true')
    store = Pipeline(cfg, 0, 1, num_threads=0).stores[0]
    assert store.dtype == np.uint32 and store.vocab_size == 70_001 and store.eos_id == 70_000
    assert [d.tolist() for d in store] == [d.tolist() for k in range(3) for d in ds[k::3]]


@pytest.mark.parametrize("streaming", [False, True])
def test_hugging_face_sources(tmp_path, streaming):
    (tmp_path / "hf").mkdir()
    write_jsonl(tmp_path / "hf" / "train.jsonl", make_texts(200, seed=3), field="body")
    write_jsonl(tmp_path / "hf" / "validation.jsonl", make_texts(20, seed=4), field="body")
    cfg = job(tmp_path, f'hf_dataset_name = "{tmp_path / "hf"}"\nhf_dataset_split = "train"\n'
                        f'hf_dataset_text_field = "body"\nhf_streaming = {str(streaming).lower()}', max_steps=5)
    (src,) = cfg.sources
    assert (src.hf_streaming, src.split, src.text_field, src.add_bos, src.add_eos) == (streaming, "train", "body",
                                                                                       False, True)
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    batch = p.batch(0)
    assert batch["inputs"].shape == (8, 64) and not (batch["inputs"] == 0).all()


MIXTURE = """
mix_temperature = 2.0
tokenizer_path = "{tok}"
pack_sequences = true
datasets = [
  {{ path = "{web}", weight = 4.0, name = "web" }},
  {{ path = "{code}", weight = 1.0, name = "code" }},
  {{ path = "{math}", weight = 1.0 }},
]
{schedule}
"""


@pytest.fixture
def three_sources(tmp_path):
    paths = {}
    for k, name in enumerate(("web", "code", "math")):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "a.npy", np.concatenate(docs(10 + k, n=400)).astype(np.uint16))
        paths[name] = tmp_path / name
    return paths


def test_phases_fall_back_to_original_weights_and_report_lr_scale(tmp_path, three_sources):
    """train.py: a source a phase does not name takes its ORIGINAL weight (not the previous
    phase's); a source without `name` is named by its path as written."""
    schedule = """phases = [
  { start_step = 10, dataset_weights = { code = 4.0 }, lr_scale = 0.5 },
  { start_step = 30, dataset_weights = { web = 0.0 }, lr_scale = 0.1 },
]"""
    cfg = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule, **three_sources))
    math = str(three_sources["math"])
    assert [s.name for s in cfg.sources] == ["web", "code", math]
    p = Pipeline(cfg, 0, 1, num_threads=0)

    def tempered(ws):  # KempnerForge's temperature: w^(1/T), renormalized
        t = {k: v ** 0.5 if v > 0 else 0.0 for k, v in ws.items()}
        return {k: v / sum(t.values()) for k, v in t.items()}

    expect = {0: tempered({"web": 4, "code": 1, math: 1}), 10: tempered({"web": 4, "code": 4, math: 1}),
              30: tempered({"web": 0, "code": 1, math: 1})}  # code is back to its original 1 at step 30
    for step, start, lr in ((0, 0, 1.0), (9, 0, 1.0), (10, 10, 0.5), (29, 10, 0.5), (30, 30, 0.1), (49, 30, 0.1)):
        phase = p.phase_at(step)
        assert phase["start_step"] == start and phase["lr_scale"] == lr
        assert phase["weights"] == pytest.approx(expect[start])
    counts = {start: np.zeros(3) for start in expect}
    for step in range(50):
        start = max(s for s in expect if s <= step)
        counts[start] += np.bincount(p.batch(step)["source_id"], minlength=3)
    for start, c in counts.items():  # the closed-form mixture stays within a few rows of the weights
        assert np.abs(c - c.sum() * np.array(list(expect[start].values()))).max() <= 3


def test_two_phases_the_second_naming_one_source(tmp_path, three_sources):
    """The issue's case, by KempnerForge's arithmetic: sources a=1, b=1; phase 1 {a: 3};
    phase 2 {b: 0.5}: a is back to 1, so the mix is [1, 0.5] / 1.5 (not [3, 0.5] / 3.5)."""
    data = f"""datasets = [{{ path = "{three_sources['web']}", name = "a" }}, {{ path = "{three_sources['code']}", name = "b" }}]
phases = [{{ start_step = 5, dataset_weights = {{ a = 3.0 }} }}, {{ start_step = 9, dataset_weights = {{ b = 0.5 }} }}]"""
    p = Pipeline(job(tmp_path, data), 0, 1, num_threads=0)
    assert p.phase_at(9)["weights"] == pytest.approx({"a": 1 / 1.5, "b": 0.5 / 1.5})


def test_a_phase_at_step_0_with_lr_scale_takes_effect_after_the_first_step(tmp_path, three_sources):
    """KempnerForge accepts a phase at step 0 and checks phases after each step: it applies
    from step 1 (with its lr_scale); of phases at 0 and 1 the later one wins."""
    web, code = three_sources["web"], three_sources["code"]
    data = f"""datasets = [{{ path = "{web}", name = "a" }}, {{ path = "{code}", name = "b" }}]
phases = [{{ start_step = 0, dataset_weights = {{ a = 3.0 }}, lr_scale = 0.5 }},
          {{ start_step = 1, dataset_weights = {{ b = 3.0 }}, lr_scale = 0.25 }},
          {{ start_step = 4, dataset_weights = {{ a = 2.0 }} }}]"""
    p = Pipeline(job(tmp_path, data), 0, 1, num_threads=0)
    assert p.phase_at(0) == {"start_step": 0, "weights": {"a": 0.5, "b": 0.5}, "lr_scale": 1.0}
    assert p.phase_at(1)["lr_scale"] == 0.25 and p.phase_at(1)["weights"] == pytest.approx({"a": 0.25, "b": 0.75})
    assert p.phase_at(4)["weights"] == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    with pytest.raises(ConfigError, match="cannot use both data.phases and data.anneal_start_step"):
        job(tmp_path, data + "\nanneal_start_step = 8\nanneal_weights = { a = 1.0 }")


def test_data_seed_orders_the_data(tmp_path, three_sources):
    """KempnerForge orders data by train.data_seed when set, else train.seed."""
    base = f'dataset_path = "{three_sources["web"]}"'
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "job.toml").write_text(f"[data]\n{base}\n[train]\nseq_len = 64\nseed = 1\ndata_seed = 9\n")
    (tmp_path / "b" / "job.toml").write_text(f"[data]\n{base}\n[train]\nseq_len = 64\nseed = 9\n")
    a, b = (DataConfig.from_toml(tmp_path / d / "job.toml") for d in "ab")
    assert a.seed == b.seed == 9
    assert DataConfig.from_toml(tmp_path / "a" / "job.toml").seed != job(tmp_path, base).seed  # seed alone: 42


def test_vision_language_jobs_are_refused(tmp_path, three_sources):
    (tmp_path / "vlm.toml").write_text(f'[data]\nhf_dataset_name = "{three_sources["web"]}"\n'
                                       '[vision_encoder]\ntype = "siglip2"\n[vlm]\nmax_text_len = 64\n')
    with pytest.raises(ConfigError, match=r"vision-language job \(\[vlm\], \[vision_encoder\]\).*no image"):
        DataConfig.from_toml(tmp_path / "vlm.toml")


def test_anneal_shortcut_and_a_phase_that_never_fires(tmp_path, three_sources):
    schedule = 'anneal_start_step = 40\nanneal_weights = { code = 5.0 }'
    cfg = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule, **three_sources))
    p = Pipeline(cfg, 0, 1, num_threads=0)
    assert p.phase_at(39)["start_step"] == 0 and p.phase_at(40)["weights"]["code"] > p.phase_at(39)["weights"]["code"]
    off = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule="anneal_start_step = 0", **three_sources))
    assert off.all_phases() == []  # 0 = disabled, as in KempnerForge
    late = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule.replace("40", "80"), **three_sources))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Pipeline(late, 0, 1, num_threads=0)
    assert any("starts at step 80, but the pipeline has 50 steps" in str(w.message) for w in caught)


def test_the_global_batch_from_the_data_parallel_size(tmp_path, three_sources):
    data = MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule="", **three_sources)
    (tmp_path / "job.toml").write_text(f"[data]\n{data}\n[train]\nseq_len = 64\nbatch_size = 3\ngrad_accum_steps = 2\n"
                                       "[distributed]\ndp_shard = -1\ndp_replicate = 2\ntp = 2\n")
    cfg = DataConfig.from_kempnerforge(tmp_path / "job.toml", world_size=8)  # dp_shard = 8 / (2 * 2) = 2
    assert cfg.global_batch_size == 3 * 2 * 2 * 2
    assert (cfg.seed, cfg.max_steps) == (42, 100_000)  # KempnerForge's defaults
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by dp_replicate\*tp\*pp\*cp\*ep = 4"):
        DataConfig.from_kempnerforge(tmp_path / "job.toml", world_size=6)


@pytest.mark.parametrize("data, match", [
    ('dataset_path = "x"\nshuffle_buffer = 10', r"unknown key\(s\) \['shuffle_buffer'\] in \[data\]"),
    ('dataset_path = "x"\npack_sequences = "yes"', r"data\.pack_sequences must be bool, got 'yes'"),
    ('dataset_path = "x"\nnum_workers = true', r"data\.num_workers must be int, got True"),
    ('datasets = [{ path = "x", weight = -1.0 }]', r"datasets\[0\]\.weight must be positive"),
    ('datasets = [{ path = "x", hf_name = "y" }]', r"datasets\[0\] needs exactly one of path and hf_name"),
    ('dataset_path = "x"\npack_sequences = true', r"pack_sequences needs the EOS id"),
])
def test_errors_name_the_key(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        job(tmp_path, data)


def test_loader_keys_reach_the_config(tmp_path, three_sources):
    data = MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule="", **three_sources)
    cfg = job(tmp_path, data + "\nnum_workers = 2\npin_memory = false\nprefetch_factor = 4")
    assert cfg.loader == {"num_workers": 2, "pin_memory": False, "prefetch_factor": 4}
    assert json.loads(json.dumps(cfg.to_dict()))["loader"] == cfg.loader


# -- KempnerForge's dataset classes ---------------------------------------------------------------


@pytest.fixture
def kf_data(tmp_path):
    (tmp_path / "npy").mkdir()
    ds = docs(20, n=300, vocab=1000)
    np.save(tmp_path / "npy" / "shard_0.npy", np.concatenate(ds[:150]).astype(np.uint16))
    np.save(tmp_path / "npy" / "shard_1.npy", np.concatenate(ds[150:]).astype(np.uint16))
    write_jsonl(tmp_path / "train.jsonl", make_texts(300, seed=8))
    return {"npy": str(tmp_path / "npy"), "jsonl": str(tmp_path / "train.jsonl"), "cache": str(tmp_path / "cache"),
            "docs": ds}


def kempnerforge_chunks(arrays, size):
    """KempnerForge's samples, as its MemoryMappedDataset defines them: each file cut into
    non-overlapping chunks of `size` tokens, in file order, the file's tail dropped."""
    return [a[i * size:(i + 1) * size] for a in arrays for i in range(len(a) // size)]


def test_memory_mapped_dataset_samples_as_kempnerforge(kf_data):
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    files = sorted(Path(kf_data["npy"]).glob("*.npy"))
    chunks = kempnerforge_chunks([np.load(f) for f in files], 33)
    plain = MemoryMappedDataset(kf_data["npy"], seq_len=33)
    assert len(plain) == len(chunks) == sum(len(np.load(f)) // 33 for f in files)
    for i in (0, 1, len(chunks) // 2, len(chunks) - 1):
        s = plain[i]
        assert sorted(s) == ["input_ids", "labels"] and s["labels"].dtype == s["input_ids"].dtype == torch.int64
        assert s["input_ids"].tolist() == chunks[i][:-1].tolist() and s["labels"].tolist() == chunks[i][1:].tolist()
    assert plain.state_dict() == {"epoch": 0, "total_samples": len(plain)}
    with pytest.raises(IndexError):
        plain[len(plain)]

    packed = MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True, eos_token_id=1)
    for i in range(0, len(packed), 5):
        p, chunk = packed[i], chunks[i]
        assert p["input_ids"].tolist() == chunk[:-1].tolist()
        after_eos = chunk[:-1] == 1  # the label after an EOS is another document's first token
        assert (p["labels"][after_eos] == -100).all() and p["labels"][~after_eos].tolist() == chunk[1:][~after_eos].tolist()
    with pytest.raises(ValueError, match="eos_token_id"):
        MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True)


def test_the_issue_example_non_overlapping_chunks_that_never_cross_files(tmp_path):
    """Two files of 160 and 150 tokens, seq_len 10: KempnerForge has 16 + 15 = 31 samples, sample
    16 starting at the second file's first token (forge-grain's packing: 30 overlapping rows)."""
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "a.npy", np.arange(0, 160, dtype=np.uint16))
    np.save(tmp_path / "d" / "b.npy", np.arange(1000, 1150, dtype=np.uint16))
    kf = MemoryMappedDataset(str(tmp_path / "d"), seq_len=10)
    assert len(kf) == 31
    assert kf[10]["input_ids"].tolist() == list(range(100, 109)) and kf[16]["input_ids"][0] == 1000
    ours = MemoryMappedDataset(str(tmp_path / "d"), seq_len=10, semantics="forge_grain")
    assert len(ours) == (310 - 1) // 9  # every token after the first is a label once
    with pytest.raises(ValueError, match="semantics='megatron': choose 'kempnerforge'"):
        MemoryMappedDataset(str(tmp_path / "d"), seq_len=10, semantics="megatron")


def test_no_files_is_a_file_not_found_error(tmp_path):
    """KempnerForge raises FileNotFoundError when no file matches; forge-grain's error is one."""
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        MemoryMappedDataset(str(tmp_path / "empty"), seq_len=10)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MemoryMappedDataset(str(tmp_path / "missing"), seq_len=10)


def test_bin_files_need_a_declared_width_never_the_file_size(tmp_path):
    """KempnerForge reads a .bin as uint32 whenever its size is a multiple of 4 (misreading
    uint16 data); here the width is declared (dtype= or vocab_size=) and checked."""
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    (tmp_path / "b").mkdir()
    tokens = np.random.default_rng(0).integers(2, 30_000, 4000).astype(np.uint16)  # 8000 bytes: a multiple of 4
    tokens.tofile(tmp_path / "b" / "tokenized_0000.bin")
    with pytest.raises(ValueError, match="does not record its dtype"):
        MemoryMappedDataset(str(tmp_path / "b"), seq_len=10, file_pattern="*.bin")
    ds = MemoryMappedDataset(str(tmp_path / "b"), seq_len=10, file_pattern="*.bin", vocab_size=32_000)
    assert len(ds) == 400 and ds[3]["input_ids"].tolist() == tokens[30:39].tolist()
    with pytest.raises(ValueError, match="uint16"):
        MemoryMappedDataset(str(tmp_path / "b"), seq_len=10, file_pattern="*.bin", dtype="uint32")


@pytest.mark.parametrize("kind", ["mm", "hf", "mixture"])
def test_a_kempnerforge_loop_on_two_gloo_ranks_resumes_exactly(kind, kf_data, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from multiproc import free_port

    args = json.dumps({k: v for k, v in kf_data.items() if k != "docs"})
    script = Path(__file__).parent / "scripts" / "kempnerforge_loop.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script), kind, args, str(tmp_path / "rank")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rep in reports:
        assert rep["resumed_equal"]
        extra = {"mm": ["doc_ids"], "hf": [], "mixture": ["dataset_idx"]}[kind]  # mm packs: KempnerForge's doc_ids
        want = ["input_ids", "labels"] + extra
        assert rep["keys"] == sorted(want)
        assert rep["dtypes"]["input_ids"] == rep["dtypes"]["labels"] == "torch.int64"
        seq = 32
        assert rep["shapes"]["input_ids"] == rep["shapes"]["labels"] == [4, seq]
    assert reports[0]["first_ids"] != reports[1]["first_ids"]  # the sampler gives each rank its own rows
    expected_state = {"mm": ["epoch", "total_samples"], "hf": ["epoch", "sample_idx", "total_sequences"],
                      "mixture": ["dataset_0", "dataset_1"]}[kind]
    assert reports[0]["ds_state"] == expected_state


def kempnerforge_stream(jsonl, seq_len, rank, world, seed, buffer, epoch=0, skip_docs=0):
    """KempnerForge's streaming samples, as its StreamingHuggingFaceDataset defines them: the
    stream shuffled by `datasets` (seed + epoch), document k to rank k % world, the rank's first
    `skip_docs` documents skipped, each document's ids then EOS, chunks of seq_len + 1."""
    import datasets
    from tokenizers import Tokenizer

    from forge_grain.tokenizer import load_tokenizer

    tok, eos = Tokenizer.from_file(str(DEFAULT_TOKENIZER)), load_tokenizer(DEFAULT_TOKENIZER).eos_id
    stream = datasets.load_dataset("json", data_files=[jsonl], split="train", streaming=True)
    stream = stream.shuffle(seed=seed + epoch, buffer_size=buffer)
    buf, out = [], []
    for k, ex in enumerate(stream):
        if k % world != rank or k // world < skip_docs:
            continue
        ids = tok.encode(ex["text"], add_special_tokens=False).ids
        if ids:
            buf += ids + [eos]
        while len(buf) >= seq_len + 1:
            out.append(buf[: seq_len + 1])
            buf = buf[seq_len + 1:]
    return out


def test_streaming_dataset_is_kempnerforge_s_stream_one_pass_at_a_time(kf_data):
    from forge_grain.bridges.kempnerforge import StreamingHuggingFaceDataset

    ds = StreamingHuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), None, 1, 2,
                                     seed=3, shuffle_buffer_size=40)  # KempnerForge's positional order
    first = [s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in ds]  # the pass ends
    assert first == kempnerforge_stream(kf_data["jsonl"], 32, 1, 2, 3, 40) and len(first) > 20
    assert ds.state_dict()["epoch"] == 1  # the next pass reshuffles with seed + 1
    second = [s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in ds]
    assert second == kempnerforge_stream(kf_data["jsonl"], 32, 1, 2, 3, 40, epoch=1) and second != first


def test_streaming_dataset_resumes_exactly_and_takes_kempnerforge_s_own_state(kf_data):
    from forge_grain.bridges.kempnerforge import StreamingHuggingFaceDataset

    def make():
        return StreamingHuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), rank=1,
                                           world_size=2, seed=3, shuffle_buffer_size=40, pack_sequences=True)

    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = ds.state_dict()
    rest = list(it)
    assert {"epoch", "rank_docs_consumed"} <= set(state) and head[0]["input_ids"].dtype == torch.int64
    again = make()
    again.load_state_dict(json.loads(json.dumps(state)))
    resumed = list(again)
    assert len(resumed) == len(rest) and all(torch.equal(a[k], b[k]) for a, b in zip(rest, resumed) for k in a)
    # a state saved by KempnerForge itself resumes as KempnerForge does: its documents skipped, the buffer lost
    kf_state = {"epoch": 0, "rank_docs_consumed": state["rank_docs_consumed"]}
    skipped = make()
    skipped.load_state_dict(kf_state)
    got = [s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in skipped]
    want = kempnerforge_stream(kf_data["jsonl"], 32, 1, 2, 3, 40, skip_docs=state["rank_docs_consumed"])
    assert [g[:-1] for g in got] == [w[:-1] for w in want] and len(got) < len(rest)


def test_streaming_dataset_under_workers_repeats_nothing(tmp_path):
    """Under DataLoader workers `datasets` deals the files to the workers (as in KempnerForge):
    two files, two workers, every document read once."""
    from torch.utils.data import DataLoader

    from forge_grain.bridges.kempnerforge import StreamingHuggingFaceDataset

    (tmp_path / "d").mkdir()
    texts = make_texts(200, seed=4)
    write_jsonl(tmp_path / "d" / "train-0.jsonl", texts[:100])
    write_jsonl(tmp_path / "d" / "train-1.jsonl", texts[100:])

    def samples(workers):
        ds = StreamingHuggingFaceDataset(str(tmp_path / "d"), "train", "text", 32, str(DEFAULT_TOKENIZER), seed=1,
                                         shuffle_buffer_size=16)
        return [tuple(b["input_ids"][0].tolist()) for b in DataLoader(ds, batch_size=1, num_workers=workers)]

    alone, pooled = samples(0), samples(2)
    assert len(set(pooled)) == len(pooled)  # nothing repeated
    assert abs(len(pooled) - len(alone)) <= 2  # each worker drops at most its own tail


def test_streaming_dataset_with_forge_grain_semantics_resumes_exactly(kf_data, tmp_path):
    from forge_grain.bridges.kempnerforge import StreamingHuggingFaceDataset

    def make():
        return StreamingHuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), rank=1,
                                           world_size=2, seed=3, semantics="forge_grain", window=40,
                                           cache_dir=kf_data["cache"])

    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = ds.state_dict()
    tail = [next(it) for _ in range(9)]
    assert {"epoch", "rank_docs_consumed", "forge_grain"} <= set(state) and head[0]["input_ids"].shape == (32,)
    again = make()
    again.load_state_dict(json.loads(json.dumps(state)))
    resumed = [s for _, s in zip(range(9), again)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(tail, resumed) for k in a)
    with pytest.raises(ValueError, match="saved with KempnerForge's semantics"):
        make().load_state_dict({"epoch": 0, "rank_docs_consumed": 12})


def test_shards_cut_inside_documents_as_kempnerforge_prepares_them_open(tmp_path, monkeypatch):
    """KempnerForge's prepare_data.py writes uint16 .npy shards of a fixed token count, cut inside
    documents and without EOS; a job with pack_sequences must still open them (forge-grain's
    whole-document check is for files declared to hold whole documents)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    flat = np.concatenate(docs(5, n=80)).astype(np.uint16)
    for k, lo in enumerate(range(0, len(flat), 1000)):
        np.save(tmp_path / "tok" / f"train_{k:04d}.npy", flat[lo : lo + 1000])  # cut at a token count
    cfg = job(tmp_path, f'dataset_path = "tok"\nfile_pattern = "train_*.npy"\ntokenizer_path = "{DEFAULT_TOKENIZER}"\n'
                        "pack_sequences = true")
    store = Pipeline(cfg, 0, 1, num_threads=0).stores[0]
    assert store.num_tokens == len(flat)
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    assert len(MemoryMappedDataset("tok", seq_len=33, file_pattern="train_*.npy", pack_sequences=True,
                                   eos_token_id=1)) > 0


def test_packed_samples_carry_kempnerforge_doc_ids(kf_data):
    """KempnerForge's train.py masks attention by batch["doc_ids"] when present: each input token's
    document, from 0, the next one starting after each EOS."""
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    ds = MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True, eos_token_id=1)
    for i in range(0, len(ds), 7):
        s = ds[i]
        ids, doc = s["input_ids"], s["doc_ids"]
        assert doc.dtype == torch.int64 and doc[0] == 0
        assert torch.equal(doc[1:], doc[:-1] + (ids[:-1] == 1).long()), i


def test_mixture_dataset_as_kempnerforge_train_py_wires_it(kf_data):
    """train.py hands `cumulative_sizes` to its MixtureSampler (sizes are their differences, offsets
    their heads), logs by `dataset_names`, and saves `state_dict()` under dataset_i keys."""
    from forge_grain.bridges.kempnerforge import MemoryMappedDataset, MixtureDataset

    a = MemoryMappedDataset(kf_data["npy"], seq_len=33)
    b = MemoryMappedDataset(kf_data["npy"], seq_len=65)
    mix = MixtureDataset([a, b], names=["web", "books"])
    c = mix.cumulative_sizes
    assert c == [0, len(a), len(a) + len(b)] and mix.dataset_names == ["web", "books"]
    sizes, offsets = [c[i + 1] - c[i] for i in range(len(c) - 1)], c[:-1]
    assert sizes == [len(a), len(b)] and len(mix) == c[-1]
    for k, (size, offset) in enumerate(zip(sizes, offsets)):
        for local in (0, size - 1):
            s = mix[offset + local]
            assert s["dataset_idx"] == k and torch.equal(s["input_ids"], [a, b][k][local]["input_ids"])
    assert sorted(mix.state_dict()) == ["dataset_0", "dataset_1"]
    mix.load_state_dict({"dataset_1": {"epoch": 3}})
    assert b.state_dict()["epoch"] == 3 and a.state_dict()["epoch"] == 0
    mix.close()  # KempnerForge's way to release the maps
    assert a.store._arrays == [] and b.store._arrays == []


def kempnerforge_hf_chunks(jsonl, seq_len):
    """KempnerForge's HuggingFaceDataset samples: documents in order, each's ids then EOS (empty
    ones skipped), joined and cut into chunks of seq_len + 1, the tail dropped."""
    from tokenizers import Tokenizer

    from forge_grain.tokenizer import load_tokenizer

    tok, eos = Tokenizer.from_file(str(DEFAULT_TOKENIZER)), load_tokenizer(DEFAULT_TOKENIZER).eos_id
    flat = []
    for line in Path(jsonl).read_text().splitlines():
        ids = tok.encode(json.loads(line)["text"], add_special_tokens=False).ids
        flat += ids + [eos] if ids else []
    n = len(flat) // (seq_len + 1)
    return [flat[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in range(n)]


def test_hugging_face_dataset_samples_as_kempnerforge(kf_data):
    from forge_grain.bridges.kempnerforge import HuggingFaceDataset

    want = kempnerforge_hf_chunks(kf_data["jsonl"], 32)
    ds = HuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), cache_dir=kf_data["cache"])
    assert len(ds) == len(want)
    assert all(ds[i]["input_ids"].tolist() + ds[i]["labels"][-1:].tolist() == want[i] for i in range(len(ds)))
    assert ds.state_dict() == {"epoch": 0, "sample_idx": 0, "total_sequences": len(want)}
    packed = HuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), None, True,
                                cache_dir=kf_data["cache"])
    assert sorted(packed[3]) == ["doc_ids", "input_ids", "labels"]
    ours = HuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER),
                              cache_dir=kf_data["cache"], semantics="forge_grain")
    assert len(ours) > len(ds)  # every token a label once: no token lost to the chunks' overlap


class KempnerForgeMemoryMapped(torch.utils.data.Dataset):
    """KempnerForge's MemoryMappedDataset as its code defines it (the reference of a mid-run switch)."""

    def __init__(self, directory, seq_len):
        self.chunks = kempnerforge_chunks([np.load(f) for f in sorted(Path(directory).glob("*.npy"))], seq_len)

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, i):
        t = torch.from_numpy(self.chunks[i].astype(np.int64))
        return {"input_ids": t[:-1], "labels": t[1:]}


def test_a_mid_run_switch_continues_with_the_same_samples(kf_data):
    """A KempnerForge run's loader (its dataset, a shuffling sampler, StatefulDataLoader) takes k
    steps and saves; the run goes on with forge-grain's class and the saved loader state: steps
    k..n are the samples KempnerForge's own dataset would have given."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from forge_grain.bridges.kempnerforge import MemoryMappedDataset

    def loader(ds):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
        return StatefulDataLoader(ds, batch_size=4, sampler=sampler)

    theirs = loader(KempnerForgeMemoryMapped(kf_data["npy"], 65))
    it = iter(theirs)
    for _ in range(6):
        next(it)
    state = theirs.state_dict()
    expected = [b["input_ids"] for b in it]
    ours = loader(MemoryMappedDataset(kf_data["npy"], 65))
    ours.load_state_dict(state)
    got = [b["input_ids"] for b in ours]
    assert len(got) == len(expected) > 10 and all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_shipped_style_job_with_bin_files_opens_unchanged(tmp_path, monkeypatch):
    """KempnerForge's shipped configs: raw tokenized_*.bin, a Hub tokenizer name, [model] vocab_size,
    and no dtype key (KempnerForge refuses one). The width comes from the model's vocabulary, checked
    against the bytes; a Hub tokenizer is needed only to find EOS, and then the error says how."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    flat = np.concatenate(docs(3, n=200, vocab=50_000))
    flat.astype(np.uint32).tofile(tmp_path / "data" / "tokenized_0000.bin")

    def load(vocab, pack=False):
        (tmp_path / "job.toml").write_text(
            f"[model]\nvocab_size = {vocab}\n[data]\ndataset_path = \"data\"\nfile_pattern = \"tokenized_*.bin\"\n"
            f"tokenizer_path = \"meta-llama/Llama-3.2-1B\"\npack_sequences = {str(pack).lower()}\n"
            "[train]\nseq_len = 64\nbatch_size = 2\nmax_steps = 5\n")
        return DataConfig.from_toml(tmp_path / "job.toml")

    store = Pipeline(load(128_256), 0, 1, num_threads=0).stores[0]  # Llama 3's vocabulary: uint32
    assert store.dtype == np.uint32 and store.num_tokens == len(flat)
    with pytest.raises(ValueError, match="uint32|width|wider"):  # a 50,304 vocabulary says uint16: the bytes disagree
        Pipeline(load(50_304), 0, 1, num_threads=0)
    with pytest.raises(ValueError, match=r"meta-llama/Llama-3.2-1B: no local tokenizer of this name and not in the "
                                         r"Hugging Face cache .*hf download meta-llama/Llama-3.2-1B tokenizer.json"):
        load(128_256, pack=True)


@pytest.mark.parametrize("dist, world, match", [
    ("dp_replicate = -2", 8, r"distributed\.dp_replicate must be a positive integer, got -2"),
    ("dp_shard = 3", 8, r"dp_replicate\*dp_shard\*tp\*pp\*cp = 3 is not the world size 8"),
    ("tp = 0", 8, r"distributed\.tp must be a positive integer, got 0"),
    ("dp_shard = -1", "abc", r"WORLD_SIZE environment variable is 'abc'"),
])
def test_parallel_sizes_are_checked(tmp_path, monkeypatch, three_sources, dist, world, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    (tmp_path / "job.toml").write_text(f'[data]\ndataset_path = "{three_sources["web"]}"\n[distributed]\n{dist}\n')
    with pytest.raises(ConfigError, match=match):
        DataConfig.from_toml(tmp_path / "job.toml")


def test_a_phase_weight_that_is_not_a_number_is_named(tmp_path, three_sources):
    data = MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule='phases = [{ start_step = 5, dataset_weights = '
                          '{ web = "high" } }]', **three_sources)
    with pytest.raises(ConfigError, match=r"data\.phases\[0\]\.dataset_weights\.web must be int or float, got 'high'"):
        job(tmp_path, data)


def test_a_declared_eos_that_the_files_cannot_hold_is_refused(tmp_path, three_sources):
    cfg = job(tmp_path, f'dataset_path = "{three_sources["web"]}"\npack_sequences = true\neos_id = 100000')
    with pytest.raises(ValueError, match="eos_id=100000 cannot occur in uint16 tokens"):
        Pipeline(cfg, 0, 1, num_threads=0)


@pytest.mark.parametrize("schedule, outcome", [
    # the last part of a path names its source (how job files written for the earlier naming call it)
    ("anneal_start_step = 20\nanneal_weights = { math = 3.0, web = 1.0 }", {"math": 3.0, "web": 1.0}),
    ("phases = [{ start_step = 20, dataset_weights = { math = 0.5 } }]", {"math": 0.5}),
    # the intended errors come first, whatever names the weights use
    ("phases = [{ start_step = -1, dataset_weights = { math = 1.0 } }]", r"start_step must be >= 0"),
    ("phases = [{ start_step = 20, dataset_weights = { math = 0.0, web = 0.0, code = 0.0 } }]",
     r"the weights are all zero"),
    ("phases = [{ start_step = 20, dataset_weights = { maths = 1.0 } }]", r"names unknown source\(s\) \['maths'\]"),
])
def test_phases_name_a_source_by_its_path_or_the_paths_last_part(tmp_path, three_sources, schedule, outcome):
    text = MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule, **three_sources)
    if isinstance(outcome, str):
        with pytest.raises(ConfigError, match=outcome):
            job(tmp_path, text)
        return
    cfg = job(tmp_path, text)
    math = str(three_sources["math"])  # named by its path as written, as KempnerForge names it
    (phase,) = cfg.all_phases()
    assert phase.weights == {"web": 4.0, "code": 1.0, math: 1.0,
                             **{math if k == "math" else k: v for k, v in outcome.items()}}


def test_a_single_dataset_paths_last_part_names_it_in_anneal_weights(tmp_path):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "a.npy", np.concatenate(docs(5, n=300)).astype(np.uint16))
    cfg = job(tmp_path, f'dataset_path = "{tmp_path / "data"}"\ntokenizer_path = "{DEFAULT_TOKENIZER}"\n'
                        'anneal_start_step = 10\nanneal_weights = { data = 1.0 }')
    (phase,) = cfg.all_phases()
    assert phase.weights == {str(tmp_path / "data"): 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Pipeline(cfg, 0, 1, num_threads=0).batch(12)["inputs"].shape == (8, 64)


def test_the_drop_ins_read_special_tokens_in_text_as_kempnerforges_tokenizer_does(tmp_path):
    """A document holding the literal string "<|endoftext|>": KempnerForge's tokenizer makes it
    the special id, so the drop-ins do too (their samples equal KempnerForge's); with
    special_tokens_in_text=False (forge-grain's own sources' default) it stays text."""
    from forge_grain.bridges.kempnerforge import HuggingFaceDataset, StreamingHuggingFaceDataset
    from forge_grain.tokenizer import load_tokenizer

    texts = [f"{t} <|endoftext|> and then {t}" if i % 3 == 0 else t for i, t in enumerate(make_texts(120, seed=9))]
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "train.jsonl", texts)
    jsonl = str(tmp_path / "d" / "train.jsonl")
    eos = load_tokenizer(DEFAULT_TOKENIZER).eos_id
    want = kempnerforge_hf_chunks(jsonl, 32)
    assert any(eos in chunk[:-1] and chunk.count(eos) > 1 for chunk in want)  # the literal string is the id there
    ds = HuggingFaceDataset(jsonl, "train", "text", 32, str(DEFAULT_TOKENIZER), cache_dir=tmp_path / "c")
    assert [ds[i]["input_ids"].tolist() + ds[i]["labels"][-1:].tolist() for i in range(len(ds))] == want
    as_text = HuggingFaceDataset(jsonl, "train", "text", 32, str(DEFAULT_TOKENIZER), cache_dir=tmp_path / "c",
                                 special_tokens_in_text=False)
    assert len(as_text) > len(ds)  # "<|endoftext|>" as characters: more tokens
    stream = StreamingHuggingFaceDataset(jsonl, "train", "text", 32, str(DEFAULT_TOKENIZER), None, 0, 1, seed=3,
                                         shuffle_buffer_size=20)
    got = [s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in stream]
    assert got == kempnerforge_stream(jsonl, 32, 0, 1, 3, 20)
