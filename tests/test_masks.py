"""Loss masks from the data: a store's target masks (`write_store(masks=)`), checked and carried
by every packing strategy into the batch's `loss_mask`.

The stores' token ids are unique (document d's tokens are ids nobody else has), so what a
batch trains is known from the batch alone: the targets under its loss mask.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from forge_grain import StoreError, TokenStore, pack, write_store
from forge_grain.stores.manifest import MANIFEST_NAME
from test_seq_lens import Trained


def unique_docs(n_docs: int, seed: int, first: int = 2, longest: int = 160):
    """Documents of unique ids (BOS 0 first) and a random target mask for each (a run of
    prompt tokens, then a run of answer tokens, repeated: as a conversation's turns)."""
    rng = np.random.default_rng(seed)
    docs, masks, g = [], [], first
    for n in rng.integers(2, longest, n_docs).tolist():
        docs.append(np.concatenate([[0], np.arange(g, g + n - 1)]))
        g += n - 1
        turns = np.cumsum(rng.integers(1, 12, n)) % 2 == 1  # alternating runs
        masks.append(turns & (rng.random(n) < 0.95))
    return docs, masks, g


def masked_store(path, n_docs=80, seed=0, **kw):
    docs, masks, end = unique_docs(n_docs, seed, **kw)
    return write_store(path, docs, vocab_size=1 << 24, bos_id=0, eos_id=1, masks=masks), docs, masks, end


def target_ids(docs, masks) -> np.ndarray:
    """The ids a masked store trains: its marked tokens, but never a document's first (no
    position predicts it)."""
    return np.concatenate([d[1:][m[1:]] for d, m in zip(docs, masks)])


def trained(ds) -> np.ndarray:
    """Every target the dataset's epoch trains, as ids."""
    b = ds.get_batch(np.arange(ds.num_rows))
    return b["targets"][b["loss_mask"]]


def test_a_masked_store_keeps_its_masks_and_verifies(tmp_path):
    path, docs, masks, _ = masked_store(tmp_path / "s")
    store = TokenStore.open(path, verify=True)
    assert store.masked and json.loads((path / MANIFEST_NAME).read_text())["version"] == 2
    for i in (0, 7, len(docs) - 1):
        assert np.array_equal(store[i], docs[i]) and np.array_equal(store.target_mask(i), masks[i])
    plain = TokenStore.open(write_store(tmp_path / "plain", docs, vocab_size=1 << 24))
    assert not plain.masked and plain.target_mask(3).all()
    assert json.loads((tmp_path / "plain" / MANIFEST_NAME).read_text())["version"] == 1  # readable as before
    assert plain.fingerprint != store.fingerprint  # the masks are part of what the data is


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), r"shard-00000.mask: holds .* mask bytes, but its shard"),
    (lambda f: f.write_bytes(b"\x02" + f.read_bytes()[1:]), r"shard-00000.mask: checksum mismatch"),
])
def test_a_damaged_mask_is_named(tmp_path, damage, message):
    path, *_ = masked_store(tmp_path / "s")
    damage(path / "shard-00000.mask")
    with pytest.raises(StoreError, match=message):
        TokenStore.open(path, verify=True)


def test_masks_that_do_not_fit_their_documents_are_refused(tmp_path):
    docs, masks, _ = unique_docs(5, 1)
    with pytest.raises(StoreError, match=r"document 2 has 9\d* tokens but a mask of shape|document 2 has"):
        write_store(tmp_path / "a", docs, vocab_size=1 << 24, masks=[*masks[:2], masks[2][:-1], *masks[3:]])
    with pytest.raises(StoreError, match="document 4 has no mask"):
        write_store(tmp_path / "b", docs, vocab_size=1 << 24, masks=masks[:4])
    with pytest.raises(StoreError, match="values other than 0 and 1"):
        write_store(tmp_path / "c", docs, vocab_size=1 << 24, masks=[m.astype(int) * 2 for m in masks])
    assert not (tmp_path / "b" / MANIFEST_NAME).exists()  # nothing half-written is a store
    assert not any(f.name.startswith(".") for f in (tmp_path / "b").iterdir())


def test_a_version_2_manifest_without_masks_is_refused(tmp_path):
    path, *_ = masked_store(tmp_path / "s")
    m = json.loads((path / MANIFEST_NAME).read_text())
    for s in m["shards"]:
        del s["mask"], s["mask_sha256"]
    (path / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(StoreError, match="shards of a version 2 store must each name a target mask"):
        TokenStore.open(path)


@pytest.mark.parametrize("strategy, kw", [
    ("bestfit", {}), ("concat", {}), ("bos_bestfit", {}), ("bestfit", {"stride": 24}), ("concat", {"window": 2}),
])
def test_every_strategy_trains_only_marked_targets(tmp_path, strategy, kw):
    path, docs, masks, end = masked_store(tmp_path / "s", n_docs=120, seed=3)
    store = TokenStore.open(path)
    ds = pack(store, 48, strategy, seed=1, cache_dir=tmp_path / "c", **{k: v for k, v in kw.items() if k != "window"})
    got = trained(ds)
    allowed = np.zeros(end, np.bool_)
    allowed[target_ids(docs, masks)] = True
    assert allowed[got].all(), "a token the store does not mark was trained"
    assert len(got) == int(ds.loss_positions.sum())  # the closed-form count (consumed, plan) is the batches'
    if strategy == "bestfit":  # every marked target exactly once an epoch
        assert np.array_equal(np.sort(got), np.sort(target_ids(docs, masks)))


# -- through the pipeline: mixtures with phases, schedules, elastic resumes, workers -------------

NAMES = ["web", "chat", "code"]  # a pre-training source, a masked chat source, a masked bos_bestfit one
STRATEGIES = {"web": "bestfit", "chat": "bestfit", "code": "bos_bestfit"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """{name: (path, ids range, allowed targets over the range, the documents' last ids)}."""
    base = tmp_path_factory.mktemp("masked_mix")
    out, first = {}, 2
    for k, name in enumerate(NAMES):
        docs, masks, end = unique_docs({"web": 60, "chat": 30, "code": 500}[name], 40 + k, first)
        path = write_store(base / name, docs, vocab_size=1 << 24, bos_id=0, eos_id=1,
                           masks=None if name == "web" else masks)
        allowed = np.zeros(end - first, np.bool_)
        allowed[target_ids(docs, masks if name != "web" else [np.ones(len(d), bool) for d in docs]) - first] = True
        out[name] = (path, range(first, end), allowed, np.array([d[-1] for d in docs]))
        first = end
    return out


def mixed_config(stores, seq_lens=None, batch_sizes=None, phases=True, steps=90):
    from forge_grain import DataConfig

    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n][0]), weight=w, strategy=STRATEGIES[n])
                 for n, w in zip(NAMES, (0.7, 0.0, 0.3))],
        # mid-training: the chat data comes in at step 20, and takes most of the mix at 50
        phases=[dict(start_step=20, weights={"web": 0.5, "chat": 0.3, "code": 0.2}),
                dict(start_step=50, weights={"web": 0.2, "chat": 0.7, "code": 0.1})] if phases else [],
        seq_len=seq_lens[-1][1] if seq_lens else 48, global_batch_size=batch_sizes[-1][1] if batch_sizes else 8,
        seed=5, num_epochs=None, max_steps=steps,
        **({"seq_lens": seq_lens} if seq_lens else {}), **({"batch_sizes": batch_sizes} if batch_sizes else {})))


def check_masked_run(stores, seq_lens, batch_sizes, resumes):
    from forge_grain import Pipeline

    config = mixed_config(stores, seq_lens, batch_sizes)
    p = Pipeline(config, 0, 1, num_threads=0)
    seen = {n: Trained(stores[n][1], None, STRATEGIES[n] == "bestfit", stores[n][2]) for n in NAMES}
    batches = []
    for s in range(config.max_steps):
        b = p.global_batch(s)
        for row in range(len(b["inputs"])):
            seen[NAMES[b["source_id"][row]]].add(b["targets"][row][b["loss_mask"][row]])
        batches.append(b)
    assert {n: v["trained_tokens"] for n, v in p.consumed(config.max_steps).items()} == {
        n: t.total for n, t in seen.items()}  # `consumed` (and `plan`) count what the masks leave
    assert seen["chat"].epoch >= 1 and seen["chat"].total > 0  # an epoch of the chat data ended, all of it once
    for step, shards in resumes:  # elastic resumes: the same rows, masks and all
        state = json.loads(json.dumps(p.state_at(step)))
        shard = step % shards
        q = Pipeline(config, shard, shards, num_threads=0, resume_from=state)
        for s in range(step, min(step + 3, config.max_steps)):
            n = p.batches.size(s) // shards
            got = q.batch(s)
            for key in ("inputs", "loss_mask"):
                assert np.array_equal(got[key], batches[s][key][shard * n:(shard + 1) * n])


def test_masked_and_unmasked_sources_mixed_in_phases_train_each_target_once(mixed):
    """The property of issue 65 on fixed cases (hypothesis draws more below): phases that bring
    the chat data in, resumes on 1, 2 and 4 shards, a sequence-length change and a batch-size
    schedule."""
    check_masked_run(mixed, None, None, [(10, 2), (25, 4), (60, 1)])
    check_masked_run(mixed, [[0, 32], [40, 64]], [[0, 4], [30, 8]], [(39, 4), (40, 2), (70, 4)])


def test_any_schedule_with_masked_sources_trains_each_marked_target_once(mixed):
    """The same, drawn: length changes, batch-size schedules and elastic resumes (a seeded
    few by default; FORGE_GRAIN_SLOW=1 draws many more)."""
    from conftest import SLOW
    from hypothesis import HealthCheck, given, settings
    from test_seq_lens import schedules

    @settings(max_examples=60 if SLOW else 4, deadline=None, derandomize=not SLOW,
              suppress_health_check=[HealthCheck.too_slow])
    @given(plan=schedules())
    def run(plan):
        check_masked_run(mixed, *plan)

    run()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_consumer_follows_the_datas_mask(mixed, workers):
    """DataLoader workers, the Hugging Face labels (-100), OLMo-core's label_mask, torchtitan's
    labels and MaxText's targets_segmentation all train exactly the batch's loss_mask, which
    is the data's mask."""
    import torch
    from torch.utils.data import DataLoader

    from forge_grain import Pipeline
    from forge_grain.bridges.jax import maxtext
    from forge_grain.bridges.olmo import olmo_batch
    from forge_grain.bridges.titan_batches import titan_batch
    from forge_grain.bridges.torch import IGNORE_INDEX, GrainIterableDataset, to_torch

    config = mixed_config(mixed, steps=60)
    ref = Pipeline(config, 0, 1, num_threads=0)
    hf = DataLoader(GrainIterableDataset(config, rank=0, world_size=1, convention="hf"), batch_size=None,
                    num_workers=workers)
    chat = NAMES.index("chat")
    for got in hf:
        s = int(got["step"])
        b = ref.batch(s)
        mask = b["loss_mask"]
        trained = got["labels"][:, 1:] != IGNORE_INDEX  # label i + 1 is position i's target
        assert torch.equal(trained, torch.from_numpy(mask[:, :-1]))
        assert torch.equal(got["labels"][:, 1:][trained], torch.from_numpy(b["targets"][:, :-1][mask[:, :-1]]))
        assert np.array_equal(olmo_batch(b)["label_mask"][:, 1:].numpy(), mask[:, :-1])
        _, labels = titan_batch(to_torch(b))
        assert torch.equal(labels != IGNORE_INDEX, torch.from_numpy(mask))
        assert np.array_equal(maxtext(b)["targets_segmentation"] != 0, mask)
        if s >= 20 and (b["source_id"] == chat).any():  # the chat rows train less than every position
            rows = b["source_id"] == chat
            assert mask[rows].sum() < (b["segment_ids"][rows] > 0).sum() - rows.sum()


# -- OLMo-core's label masks, read in place ------------------------------------------------------


def olmo_sft_files(base, n_files=2, seed=9):
    """Token files and label mask files as OLMo-core's SFT data holds them: header-less uint32
    memmaps of documents ending in EOS (1), and a header-less bool memmap per token file."""
    docs, masks, _ = unique_docs(70, seed, first=2)
    docs = [np.concatenate([d[1:], [1]]) for d in docs]  # no BOS; EOS last (a target: the turn's end)
    masks = [np.concatenate([m[1:], [True]]) for m in masks]
    per = -(-len(docs) // n_files)
    for k in range(n_files):
        np.concatenate(docs[k * per:(k + 1) * per]).astype(np.uint32).tofile(base / f"token_ids_part_{k:04d}.npy")
        np.concatenate(masks[k * per:(k + 1) * per]).astype(np.bool_).tofile(base / f"labels_mask_part_{k:04d}.npy")
    return sorted(base.glob("token_ids_*.npy")), sorted(base.glob("labels_mask_*.npy"))


def test_olmo_core_label_masks_read_in_place_are_olmo_cores(tmp_path):
    """A directory as OLMo-core's SFT data sits (token_ids_part_*.npy beside labels_mask_part_*.npy),
    opened with `label_masks`: each instance's label_mask that OLMo-core's own NumpyFSLDataset
    reads from these files is the store's target mask over the same tokens."""
    numpy_dataset = pytest.importorskip("olmo_core.data.numpy_dataset")
    tokens, labels = olmo_sft_files(tmp_path)
    store = TokenStore.open(tmp_path, dtype="uint32", eos_id=1, vocab_size=1 << 24, file_pattern="token_ids_*.npy",
                            label_masks="labels_mask_*.npy", verify=True)
    assert store.masked and len(store.files) == 2
    ours = np.concatenate([store.target_mask(i) for i in range(len(store))])
    length = 32
    theirs = numpy_dataset.NumpyFSLDataset(*tokens, sequence_length=length, pad_token_id=0, eos_token_id=1,
                                           vocab_size=1 << 24, dtype=np.uint32, label_mask_paths=labels)
    theirs.prepare()
    starts = np.concatenate([[0], np.cumsum([np.fromfile(f, np.uint32).size for f in tokens])])
    for i in range(len(theirs)):
        item = theirs[i]
        file = next(k for k, (a, b) in enumerate(theirs.offsets) if a <= i < b)
        at = starts[file] + (i - theirs.offsets[file][0]) * length
        assert np.array_equal(item["label_mask"].numpy(), ours[at:at + length])
        assert np.array_equal(item["input_ids"].numpy(), store.tokens(at, at + length))


def test_label_masks_that_do_not_fit_are_named(tmp_path):
    tokens, labels = olmo_sft_files(tmp_path)
    common = dict(dtype="uint32", eos_id=1, vocab_size=1 << 24)
    with pytest.raises(StoreError, match="a label mask file is also read as a token file; set file_pattern"):
        TokenStore.open(tmp_path, label_masks="labels_mask_*.npy", **common)
    with pytest.raises(StoreError, match=r"label_masks names 1 file\(s\) for 2 token file\(s\)"):
        TokenStore.open(tmp_path, file_pattern="token_ids_*.npy", label_masks=[labels[0].name], **common)
    labels[1].write_bytes(labels[1].read_bytes()[:-3])
    with pytest.raises(StoreError, match=r"labels_mask_part_0001.npy: holds \d+ label mask entries, but its token"):
        TokenStore.open(tmp_path, file_pattern="token_ids_*.npy", label_masks="labels_mask_*.npy", **common)


def test_a_config_trains_olmo_core_sft_data_by_its_label_masks(tmp_path):
    from forge_grain import DataConfig, Pipeline

    tokens, labels = olmo_sft_files(tmp_path)
    store = TokenStore.open(tmp_path, dtype="uint32", eos_id=1, vocab_size=1 << 24, file_pattern="token_ids_*.npy",
                            label_masks="labels_mask_*.npy")
    allowed = np.zeros(1 << 16, np.bool_)
    for i in range(len(store)):
        doc, m = store[i], store.target_mask(i)
        allowed[doc[1:][m[1:]]] = True
    allowed[1] = True  # (EOS ids repeat: it is a target wherever its mask says so)
    config = DataConfig.from_dict(dict(sources=[dict(name="sft", path=str(tmp_path), dtype="uint32", eos_id=1,
                                                     vocab_size=1 << 24, file_pattern="token_ids_*.npy",
                                                     label_masks="labels_mask_*.npy")],
                                       seq_len=32, global_batch_size=4, seed=1, num_epochs=1))
    p = Pipeline(config, 0, 1, num_threads=0)
    total = 0
    for s in range(p.num_steps):
        b = p.batch(s)
        got = b["targets"][b["loss_mask"]]
        assert allowed[got].all()
        total += len(got)
    assert 0 < total == p.consumed(p.num_steps)["sft"]["trained_tokens"]


def test_explain_and_plan_say_what_the_mask_trains(mixed):
    """`explain` names the target runs of a masked source's documents, and they are where the
    batch's loss mask is; `describe` (what `plan` prints) says the source is masked."""
    from forge_grain import Pipeline

    p = Pipeline(mixed_config(mixed), 0, 1, num_threads=0)
    seen = 0
    for step in (25, 60):
        b = p.global_batch(step)
        for row in p.explain(step):
            for seg in row["segments"]:
                lo, hi = seg["tokens"]
                marked = np.zeros(hi - lo, np.bool_)
                for a, c in seg.get("targets", [[lo, hi]]):
                    marked[a - lo:c - lo] = True
                slot = seg["slots"][0]
                # slot j's target is token lo + (j - slot) + 1: trained exactly where the data marks it
                trained = b["loss_mask"][row["row"]][slot:slot + hi - lo - 1]
                assert np.array_equal(trained, marked[1:])
                seen += "targets" in seg
    assert seen > 0
    described = {s["name"]: s["masked"] for s in p.describe()["sources"]}
    assert described == {"web": False, "chat": True, "code": True}


def test_inspect_counts_the_targets(tmp_path):
    from forge_grain.packing.summary import format_summary

    path, docs, masks, _ = masked_store(tmp_path / "s")
    marked = sum(int(m.sum()) for m in masks)
    assert f"targets     {marked:,} (" in format_summary(TokenStore.open(path))
    assert "targets" not in format_summary(TokenStore.open(write_store(tmp_path / "p", docs, vocab_size=1 << 24)))


def test_a_label_mask_of_another_dtype_or_other_values_is_named(tmp_path):
    """A label mask file that is not one: a .npy of int32 (its header says so), or bytes other
    than 0 and 1 (another file given as masks), each named."""
    tokens, labels = olmo_sft_files(tmp_path)
    common = dict(dtype="uint32", eos_id=1, vocab_size=1 << 24, file_pattern="token_ids_*.npy",
                  label_masks="labels_mask_*.npy")
    n = len(np.fromfile(labels[0], np.uint8))
    np.save(labels[0], np.ones(n, np.int32))  # (np.save of a path ending .npy writes it in place)
    with pytest.raises(StoreError, match=r"labels_mask_part_0000.npy: a label mask is a 1-D bool \(or uint8\) array"):
        TokenStore.open(tmp_path, **common)
    np.full(n, 7, np.uint8).tofile(labels[0])
    with pytest.raises(StoreError, match=r"labels_mask_part_0000.npy: a label mask holds the byte 7"):
        TokenStore.open(tmp_path, **common)
