"""`forge-grain plan CONFIG` / `Pipeline.describe()`: the run a config describes, before training,
equal to what iterating the pipeline gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import config, store, write_jsonl, make_texts

from forge_grain import DataConfig, Pipeline
from forge_grain.cli import main


@pytest.fixture
def stores(tmp_path):
    return {name: store(tmp_path / name, n, k) for k, (name, n) in enumerate((("web", 400), ("code", 250), ("math", 60)))}


def test_describe_matches_what_iterating_the_pipeline_gives(stores):
    cfg = config(stores, phases=[{"start_step": 6, "weights": {"web": 0.2, "code": 0.2, "math": 0.6}}])
    p = Pipeline(cfg, 0, 1, num_threads=0)
    d = p.describe()
    assert d["steps"] == p.num_steps and d["tokens_per_step"] == cfg.global_batch_size * cfg.seq_len
    seen = np.zeros(3, int)
    for step in range(p.num_steps):
        seen += np.bincount(p.batch(step)["source_id"], minlength=3)
    by_name = {s["name"]: s for s in d["sources"]}
    for k, name in enumerate(("web", "code", "math")):
        s = by_name[name]
        assert s["rows"] == seen[k] == p.consumed(p.num_steps)[name]["rows"]
        assert s["epochs"] == pytest.approx(seen[k] / s["rows_per_epoch"])
        assert 0 < s["fill"] <= 1 and s["trained_tokens"] > 0
    assert [ph["start_step"] for ph in d["phases"]] == [0, 6] and all(ph["reached"] for ph in d["phases"])


def test_a_kempnerforge_job_that_repeats_a_small_source_is_warned_about(tmp_path, stores, capsys):
    """KempnerForge's default max_steps (100,000) over a small source: it is read hundreds of
    times, which nothing showed before training."""
    (tmp_path / "job.toml").write_text(f'[data]\ndatasets = [{{ path = "{stores["math"]}", name = "math" }}, '
                                       f'{{ path = "{stores["web"]}", name = "web" }}]\n'
                                       "phases = [{ start_step = 200000, dataset_weights = { math = 2.0 } }]\n"
                                       "[train]\nseq_len = 64\nbatch_size = 4\n")
    assert main(["plan", str(tmp_path / "job.toml"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "100,000 steps of 8 rows x 64 tokens" in out
    assert "! source 'math' is read" in out and "times over the run" in out
    assert "! a phase starting at step 200000 never takes effect" in out
    assert main(["plan", str(tmp_path / "job.toml"), "--json", "--steps", "10", "--world-size", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["steps"] == 10 and sum(s["rows"] for s in d["sources"]) == 80


def test_a_streaming_source_is_described_from_its_counting_pass(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", make_texts(300, seed=2))
    cfg = DataConfig(sources=[dict(name="s", hf_dataset=str(tmp_path / "t.jsonl"), hf_streaming=True)], seq_len=32,
                     global_batch_size=4, num_epochs=2)
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    (s,) = p.describe()["sources"]
    assert s["streaming"] and s["rows_per_epoch"] > 0 and s["epochs"] == pytest.approx(2, rel=0.05)


@pytest.mark.parametrize("strategy", ["bestfit", "bos_bestfit"])
def test_a_streaming_source_reports_the_fill_and_crop_its_batches_have(tmp_path, strategy):
    write_jsonl(tmp_path / "t.jsonl", make_texts(400, seed=3))
    cfg = DataConfig(sources=[dict(name="s", hf_dataset=str(tmp_path / "t.jsonl"), hf_streaming=True, window=50,
                                   strategy=strategy)], seq_len=32, global_batch_size=4, canonical_streams=1)
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    (s,) = p.describe()["sources"]
    batches = [p.batch(step)["segment_ids"] for step in range(p.num_steps)]  # the epoch, all but its last rows
    assert s["fill"] == pytest.approx(float((np.concatenate(batches) > 0).mean()), abs=0.01)
    if strategy == "bestfit":
        assert s["cropped_share"] == 0  # long documents are split, never cropped
    else:
        assert 0 < s["cropped_share"] < 0.5  # rows start at a BOS: the tails that do not fit are cropped


def test_the_plot_draws_the_shares_each_step_range_actually_got(tmp_path, stores, capsys):
    from forge_grain.pipeline.plot import shares_over_steps

    p = Pipeline(config(stores, phases=[{"start_step": 6, "weights": {"web": 0.0, "code": 0.0, "math": 1.0}}]),
                 0, 1, num_threads=0)
    bounds, shares = shares_over_steps(p, p.num_steps)
    assert bounds[0] == 0 and bounds[-1] == p.num_steps and list(shares) == ["web", "code", "math"]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):  # against the batches' own source ids
        ids = np.concatenate([p.batch(s)["source_id"] for s in range(a, b)])
        assert [shares[n][i] for n in shares] == pytest.approx(np.bincount(ids, minlength=3) / len(ids))
    assert all(shares["math"][i] == 1 for i in range(len(bounds) - 1) if bounds[i] >= 6)

    toml = tmp_path / "data.toml"
    toml.write_text(f'seq_len = 64\nglobal_batch_size = 8\nmax_steps = 40\n[[sources]]\nname = "web"\npath = "{stores["web"]}"\n'
                    f'[[sources]]\nname = "code"\npath = "{stores["code"]}"\n'
                    '[[phases]]\nstart_step = 20\nweights = { code = 1.0 }\n')
    assert main(["plan", str(toml), "--plot", str(tmp_path / "mix.png")]) == 0
    assert f"plot: {tmp_path / 'mix.png'}" in capsys.readouterr().out
    assert (tmp_path / "mix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_source_mostly_cropped_is_warned_about_with_the_fix(tmp_path, capsys):
    """Long documents under bos_bestfit at a short seq_len lose most of their tokens (86% in a
    user's run), which `plan` showed only as a number."""
    rng = np.random.default_rng(0)
    long_docs = [np.concatenate([[0], rng.integers(2, 1000, 400), [1]]) for _ in range(60)]
    from forge_grain import write_store

    write_store(tmp_path / "long", long_docs, vocab_size=1000, bos_id=0, eos_id=1)
    (tmp_path / "run.toml").write_text(f'seq_len = 64\nglobal_batch_size = 4\nnum_epochs = 1\n[[sources]]\n'
                                       f'name = "long"\npath = "{tmp_path / "long"}"\nstrategy = "bos_bestfit"\n')
    assert main(["plan", str(tmp_path / "run.toml")]) == 0
    out = capsys.readouterr().out
    assert "! source 'long' loses 8" in out and "to cropping under bos_bestfit at seq_len 64" in out
    assert "use strategy 'bestfit'" in out
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text().replace("bos_bestfit", "bestfit"))
    assert main(["plan", str(tmp_path / "run.toml")]) == 0
    assert "cropping" not in capsys.readouterr().out
