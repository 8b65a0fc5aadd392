"""KempnerForge job files load as they are, with KempnerForge's meaning."""

from __future__ import annotations

import json
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


def test_phases_keep_unnamed_weights_and_report_lr_scale(tmp_path, three_sources):
    schedule = """phases = [
  { start_step = 10, dataset_weights = { code = 4.0 }, lr_scale = 0.5 },
  { start_step = 30, dataset_weights = { web = 0.0 }, lr_scale = 0.1 },
]"""
    cfg = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule, **three_sources))
    p = Pipeline(cfg, 0, 1, num_threads=0)

    def tempered(ws):  # KempnerForge's temperature: w^(1/T), renormalized
        t = {k: v ** 0.5 if v > 0 else 0.0 for k, v in ws.items()}
        return {k: v / sum(t.values()) for k, v in t.items()}

    expect = {0: tempered({"web": 4, "code": 1, "math": 1}), 10: tempered({"web": 4, "code": 4, "math": 1}),
              30: tempered({"web": 0, "code": 4, "math": 1})}  # math is never named: it keeps weight 1
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


def test_anneal_shortcut_and_a_phase_that_never_fires(tmp_path, three_sources):
    schedule = 'anneal_start_step = 40\nanneal_weights = { math = 5.0 }'
    cfg = job(tmp_path, MIXTURE.format(tok=DEFAULT_TOKENIZER, schedule=schedule, **three_sources))
    p = Pipeline(cfg, 0, 1, num_threads=0)
    assert p.phase_at(39)["start_step"] == 0 and p.phase_at(40)["weights"]["math"] > p.phase_at(39)["weights"]["math"]
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


def test_memory_mapped_dataset_samples_as_kempnerforge(kf_data):
    import torch

    from bridges.kempnerforge import MemoryMappedDataset

    plain = MemoryMappedDataset(kf_data["npy"], seq_len=33)
    s = plain[0]
    assert sorted(s) == ["input_ids", "labels"] and s["input_ids"].shape == (32,) and s["labels"].dtype == torch.int64
    assert torch.equal(s["labels"][:-1], s["input_ids"][1:])  # labels are the next tokens
    assert plain.state_dict() == {"epoch": 0, "total_samples": len(plain)}
    tokens = sum(len(d) for d in kf_data["docs"])
    assert len(plain) == (tokens - 1) // 32  # every token after the first is a label once; no file tail dropped
    packed = MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True, eos_token_id=1)
    crossings = 0
    for i in range(min(len(packed), 30)):
        p = packed[i]
        crossing = p["segment_ids"][1:] != p["segment_ids"][:-1]  # the label at j is the token at j + 1
        assert (p["labels"][:-1][crossing] == -100).all()
        crossings += int(crossing.sum())
    assert crossings > 0  # rows do hold several documents
    with pytest.raises(ValueError, match="eos_token_id"):
        MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True)


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
        extra = {"mm": ["doc_ids", "position_ids", "segment_ids"], "hf": [], "mixture": ["dataset_idx"]}[kind]  # mm packs
        want = ["input_ids", "labels"] + extra
        assert rep["keys"] == sorted(want)
        assert rep["dtypes"]["input_ids"] == rep["dtypes"]["labels"] == "torch.int64"
        seq = 32
        assert rep["shapes"]["input_ids"] == rep["shapes"]["labels"] == [4, seq]
    assert reports[0]["first_ids"] != reports[1]["first_ids"]  # the sampler gives each rank its own rows
    expected_state = {"mm": ["epoch", "total_samples"], "hf": ["epoch", "sample_idx", "total_sequences"],
                      "mixture": ["dataset_0", "dataset_1"]}[kind]
    assert reports[0]["ds_state"] == expected_state


def test_streaming_dataset_resumes_exactly_from_its_state(kf_data, tmp_path):
    import torch

    from bridges.kempnerforge import StreamingHuggingFaceDataset

    def make():
        return StreamingHuggingFaceDataset(kf_data["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), rank=1,
                                           world_size=2, seed=3, shuffle_buffer_size=40, cache_dir=kf_data["cache"])

    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = ds.state_dict()
    tail = [next(it) for _ in range(9)]
    assert {"epoch", "rank_docs_consumed", "forge_grain"} <= set(state)
    assert head[0]["input_ids"].shape == (32,) and head[0]["input_ids"].dtype == torch.int64
    again = make()
    again.load_state_dict(json.loads(json.dumps(state)))
    resumed = [s for _, s in zip(range(9), again)]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(tail, resumed) for k in a)
    with pytest.raises(ValueError, match="saved by KempnerForge itself"):
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
    from bridges.kempnerforge import MemoryMappedDataset

    assert len(MemoryMappedDataset("tok", seq_len=33, file_pattern="train_*.npy", pack_sequences=True,
                                   eos_token_id=1)) > 0


def test_packed_samples_carry_kempnerforge_doc_ids(kf_data):
    """KempnerForge's train.py masks attention by batch["doc_ids"] when present: each input token's
    document, from 0, the next one starting after each EOS."""
    from bridges.kempnerforge import MemoryMappedDataset

    ds = MemoryMappedDataset(kf_data["npy"], seq_len=33, pack_sequences=True, eos_token_id=1)
    for i in range(0, len(ds), 7):
        s = ds[i]
        ids, doc = s["input_ids"], s["doc_ids"]
        assert doc.dtype == torch.int64 and doc[0] == 0
        assert torch.equal(doc[1:], doc[:-1] + (ids[:-1] == 1).long()), i


def test_mixture_dataset_as_kempnerforge_train_py_wires_it(kf_data):
    """train.py hands `cumulative_sizes` to its MixtureSampler (sizes are their differences, offsets
    their heads), logs by `dataset_names`, and saves `state_dict()` under dataset_i keys."""
    from bridges.kempnerforge import MemoryMappedDataset, MixtureDataset

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
