"""Varlen attention metadata and the model-facing interfaces: for random batches of every
packing strategy, attention through each interface equals attention computed row by row
with an explicit per-document causal mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_grain import pack
from forge_grain.packing.varlen import doc_lens, varlen
from forge_grain.stores.writer import write_store

STRATEGIES = [("bestfit", None), ("bos_bestfit", None), ("concat", None), ("bestfit", 24)]  # 24: overlapping windows
SEQ_LEN, ROWS, HEADS, DIM = 32, 6, 2, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(2.3, 1.0, 300), 1, 90).astype(int)  # many short documents, a few longer than a row
    docs = [np.concatenate([[0], rng.integers(2, 500, n)]) for n in lengths]
    return write_store(tmp_path_factory.mktemp("varlen") / "s", docs, vocab_size=500, bos_id=0, eos_id=1)


def batches(store, seed=0):
    """(strategy, batch) for random rows of every strategy."""
    rng = np.random.default_rng(seed)
    for strategy, stride in STRATEGIES:
        ds = pack(store, SEQ_LEN, strategy, stride=stride, seed=seed)
        yield f"{strategy}{'' if stride is None else f'-stride{stride}'}", ds.get_batch(rng.integers(0, len(ds), ROWS))


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, HEADS, SEQ_LEN, DIM, generator=g, dtype=torch.float64) for _ in range(3)]


def reference(q, k, v, segment_ids) -> torch.Tensor:
    """Row by row, an explicit mask: same segment and not in the future."""
    out = torch.empty_like(q)
    causal = torch.tril(torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool))
    for r in range(ROWS):
        seg = torch.as_tensor(segment_ids[r])
        mask = (seg[:, None] == seg[None, :]) & causal
        scores = (q[r] @ k[r].transpose(-1, -2)) / DIM**0.5
        out[r] = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v[r]
    return out


def test_doc_lens_and_cu_seqlens_follow_the_padding_rule(store):
    for name, b in batches(store):
        seg = b["segment_ids"]
        lens = doc_lens(seg)
        assert lens.shape == (ROWS, SEQ_LEN) and (lens.sum(1) == SEQ_LEN).all(), name
        meta = varlen(b)
        cu = meta["cu_seqlens"]
        real = int((lens > 0).sum())
        assert cu.dtype == np.int32 and len(cu) == ROWS * SEQ_LEN + 1, name
        assert (np.diff(cu[: real + 1]) > 0).all() and (cu[real:] == ROWS * SEQ_LEN).all(), name
        # row boundaries are always cut: every row starts a sequence
        assert set(range(0, ROWS * SEQ_LEN, SEQ_LEN)) <= set(cu[:real].tolist()), name
        assert meta["max_seqlen"] == int(lens.max())
        assert varlen(b, max_segments=int((lens > 0).sum(1).max()))["cu_seqlens"][: real + 1].tolist() == \
            cu[: real + 1].tolist()
    with pytest.raises(ValueError, match="more than max_segments=1"):
        doc_lens(np.array([[1, 1, 2, 0]]), max_segments=1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager is the reference here
def test_flex_attention_with_the_document_block_mask_equals_the_explicit_mask(store):
    from torch.nn.attention.flex_attention import flex_attention

    from forge_grain.bridges.torch_varlen import document_block_mask

    for name, b in batches(store, seed=1):
        q, k, v = qkv(1)
        mask = document_block_mask(b["segment_ids"], block_size=16)
        got = flex_attention(q, k, v, block_mask=mask)
        torch.testing.assert_close(got, reference(q, k, v, b["segment_ids"]), msg=name)


def test_the_readmes_compiled_flex_attention_is_exact_and_quiet(store):
    """The README's snippet (compiled) gives the explicit mask's output and no warning."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from forge_grain.bridges.torch_varlen import document_block_mask

    attention = torch.compile(flex_attention)
    name, b = next(iter(batches(store, seed=3)))
    q, k, v = (t.float() for t in qkv(3))  # (compiled on CPU: float32, float16 or bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = attention(q, k, v, block_mask=document_block_mask(b["segment_ids"]))
    torch.testing.assert_close(got, reference(q, k, v, b["segment_ids"]), msg=name, atol=1e-4, rtol=1e-4)
    assert not [w for w in caught if "flex_attention" in str(w.message)], [str(w.message)[:200] for w in caught]


def test_varlen_attention_over_cu_seqlens_equals_the_explicit_mask(store):
    from forge_grain.bridges.torch_varlen import flash_varlen_kwargs, varlen_attention

    for name, b in batches(store, seed=2):
        q, k, v = qkv(2)
        kw = flash_varlen_kwargs(b)
        assert int(kw["cu_seqlens_q"].diff().max()) == kw["max_seqlen_q"]
        flat = [t.transpose(1, 2).reshape(ROWS * SEQ_LEN, HEADS, DIM) for t in (q, k, v)]  # [tokens, heads, dim]
        out = varlen_attention(*flat, kw["cu_seqlens_q"])
        want = reference(q, k, v, b["segment_ids"]).transpose(1, 2).reshape(ROWS * SEQ_LEN, HEADS, DIM)
        torch.testing.assert_close(out, want, msg=name)


def test_hugging_face_padding_free_kwargs_give_each_document_its_own_forward(store):
    transformers = pytest.importorskip("transformers")
    from forge_grain.bridges.torch_varlen import padding_free

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    for name, b in batches(store, seed=3):
        kw = padding_free(b)
        with torch.no_grad():
            out = model(**kw)
            logits = out.logits[0].reshape(ROWS, SEQ_LEN, -1)
            for r in range(ROWS):
                seg = b["segment_ids"][r]
                for s in np.unique(seg[seg > 0]):
                    at = np.flatnonzero(seg == s)
                    alone = model(input_ids=torch.as_tensor(b["inputs"][r, at][None], dtype=torch.long)).logits[0]
                    torch.testing.assert_close(logits[r, at], alone, atol=1e-4, rtol=1e-4, msg=name)
        labels = kw["labels"].reshape(ROWS, SEQ_LEN).numpy()
        assert ((labels[:, 1:] != -100) == b["loss_mask"][:, :-1]).all() and (labels[:, 0] == -100).all()
        assert torch.isfinite(out.loss)


def test_jax_document_mask_splash_segment_ids_and_the_maxtext_keys(store):
    jax = pytest.importorskip("jax")
    from forge_grain.bridges.jax import MAXTEXT_KEYS, document_mask, maxtext, splash_segment_ids

    for name, b in batches(store, seed=4):
        q, k, v = qkv(4)
        as_jax = lambda t: jax.numpy.asarray(t.transpose(1, 2).numpy(), jax.numpy.float32)  # noqa: E731  [B, T, N, H]
        got = jax.nn.dot_product_attention(as_jax(q), as_jax(k), as_jax(v), mask=document_mask(b["segment_ids"]))
        want = reference(q, k, v, b["segment_ids"]).transpose(1, 2).numpy()
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=name)
        ids = splash_segment_ids(b["segment_ids"])
        assert (np.asarray(ids.q) == b["segment_ids"]).all() and (np.asarray(ids.kv) == b["segment_ids"]).all()
        m = maxtext(b)
        assert set(MAXTEXT_KEYS) <= set(m)
        assert ((m["targets_segmentation"] != 0) == b["loss_mask"]).all()
        assert (m["inputs_segmentation"] == b["segment_ids"]).all() and (m["targets_position"] == b["positions"]).all()


def test_a_pipeline_with_max_segments_per_row_caps_every_row_and_resumes(store, tmp_path):
    from forge_grain import DataConfig, Pipeline

    def config(cap):
        return DataConfig.from_dict(dict(
            sources=[dict(name=s, path=str(store), strategy=s, weight=1.0) for s in ("bestfit", "bos_bestfit", "concat")],
            seq_len=SEQ_LEN, global_batch_size=8, seed=2, max_segments_per_row=cap))

    capped = Pipeline(config(2), 0, 1, num_threads=0, cache_dir=tmp_path)
    batches = [capped.batch(s) for s in range(6)]
    assert all((b["segment_ids"].max(1) <= 2).all() for b in batches)
    assert all(varlen(b, max_segments=3)["doc_lens"].shape == (8, 3) for b in batches)  # 2 documents + padding
    assert capped.fingerprint != Pipeline(config(None), 0, 1, num_threads=0, cache_dir=tmp_path).fingerprint
    again = Pipeline(config(2), 0, 1, num_threads=0, cache_dir=tmp_path).iterator(capped.state_at(3))
    for want in batches[3:]:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_inspect_reports_the_fill_a_cap_on_documents_per_row_costs(store):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "forge_grain", "inspect", str(store), "--seq-len", "32",
                        "--max-segments", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for strategy in ("bestfit", "bos_bestfit", "concat"):
        assert f"{strategy}, <= 2/row" in r.stdout
    assert "points)" in r.stdout


def test_the_bridges_add_varlen_metadata_on_request(store, tmp_path):
    from forge_grain import DataConfig, Pipeline

    cfg = DataConfig.from_dict(dict(sources=[dict(name="web", path=str(store), strategy="bestfit")], seq_len=SEQ_LEN,
                                    global_batch_size=4, seed=1, max_segments_per_row=3))
    reference = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path)
    from forge_grain.bridges.torch import GrainIterableDataset

    batch = next(iter(GrainIterableDataset(cfg, rank=0, world_size=1, varlen=True, cache_dir=tmp_path)))
    want = varlen(reference.batch(0), max_segments=4)
    assert batch["cu_seqlens"].tolist() == want["cu_seqlens"].tolist() and batch["max_seqlen"] == want["max_seqlen"]
    assert batch["doc_lens"].shape == (4, 4) and (batch["doc_lens"].sum(1) == SEQ_LEN).all()
    jax = pytest.importorskip("jax")
    from forge_grain.bridges.jax import JaxIterator

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    it = JaxIterator(Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path), sharding, varlen=True,
                     convention="maxtext")
    got = next(it)
    assert np.array_equal(np.asarray(got["doc_lens"]), want["doc_lens"]) and "inputs_segmentation" in got
    it.close()
