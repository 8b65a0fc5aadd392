"""The flight recorder: `explain` names the documents of every row, `batch_hash` fingerprints a
global batch, `forge-grain explain / replay / hashes` give the same from the command line.

The stores here give every token position its own id (BOS apart), so an independent decoder
(a map from id to document and offset, built from the documents alone) checks every slot
`explain` accounts for."""

from __future__ import annotations

import json

import numpy as np
import pytest

from forge_grain import DataConfig, Pipeline, write_store
from forge_grain.cli import main
from forge_grain.pipeline.explain import hash_batch

BOS, EOS, VOCAB = 0, 1, 200_000
KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


def unique_docs(n: int, first_id: int, seed: int) -> list[np.ndarray]:
    """`n` documents: a BOS, then ids no other position of any store has."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], first_id
    for length in rng.integers(3, 150, n):
        docs.append(np.concatenate([[BOS], np.arange(next_id, next_id + length)]))
        next_id += length
    return docs


@pytest.fixture(scope="module")
def unique_stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("unique")
    out, first = {}, 2
    for k, name in enumerate(("web", "code", "math")):
        docs = unique_docs((300, 200, 80)[k], first, k)
        first = int(docs[-1][-1]) + 1
        out[name] = write_store(base / name, docs, vocab_size=VOCAB, bos_id=BOS, eos_id=EOS)
    return out


def decoder(stores: dict) -> dict[int, tuple[str, int, int]]:
    """id -> (store path, document, offset), from the documents alone."""
    from forge_grain import TokenStore

    where = {}
    for path in stores.values():
        store = TokenStore.open(path)
        for doc in range(len(store)):
            for offset, token in enumerate(store[doc].tolist()):
                if token != BOS:
                    where[token] = (str(path), doc, offset)
    return where


def config(stores: dict, **kw) -> DataConfig:
    sources = [dict(name=n, path=str(p), weight=w, strategy=s)
               for (n, p), w, s in zip(stores.items(), (0.5, 0.3, 0.2), ("bos_bestfit", "bestfit", "concat"))]
    return DataConfig.from_dict({**dict(sources=sources, seq_len=64, global_batch_size=8, seed=11), **kw})


def check_rows(explained: list[dict], batch: dict, stores: dict, where: dict) -> None:
    """Every segment `explain` names is the row's tokens at its slots; every token slot is named."""
    for row, e in zip(range(len(explained)), explained):
        covered = np.zeros(batch["inputs"].shape[1], bool)
        path = str(stores[e["source"]])
        for ordinal, seg in enumerate(e["segments"], start=1):
            (lo, hi), (a, b) = seg["tokens"], seg["slots"]
            got = batch["inputs"][row, a:b]
            for slot, token in zip(range(a, b), got.tolist()):
                if token != BOS:  # the independent decoder: this id is at this place and nowhere else
                    assert where[token] == (path, seg["document"], lo + slot - a), (e, seg, slot)
            assert np.all(batch["segment_ids"][row, a:b] == ordinal)
            covered[a:b] = True
        assert np.array_equal(covered, batch["segment_ids"][row] > 0), e


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_explain_names_every_token_of_every_row_on_any_shard_count(unique_stores, shards):
    cfg = config(unique_stores, phases=[{"start_step": 7, "weights": {"math": 0.9, "web": 0.1}}])
    where = decoder(unique_stores)
    pipelines = [Pipeline(cfg, k, shards, num_threads=0) for k in range(shards)]
    for step in (0, 3, 7, 19, 40):  # 40: past the smaller sources' first epoch
        whole = pipelines[0].explain(step)
        assert [e["row"] for e in whole] == list(range(8))
        for k, p in enumerate(pipelines):
            part = p.explain(step, shard=k)
            assert part == [e for e in whole if e["shard"] == k]
            check_rows(part, p.batch(step), unique_stores, where)
    assert {e["source"] for step in range(20) for e in pipelines[0].explain(step)} == {"web", "code", "math"}
    assert any(e["epoch"] > 0 for e in pipelines[0].explain(60) if e["source"] == "math")


def test_explain_follows_a_mixture_change_at_resume(unique_stores):
    where = decoder(unique_stores)
    before = Pipeline(config(unique_stores), 0, 1, num_threads=0)
    changed = config(unique_stores)
    changed.sources[2].weight = 2.0
    after = Pipeline(changed, 0, 1, num_threads=0, resume_from=before.state_at(5), allow_mixture_change=True)
    for step in (5, 9, 30):
        check_rows(after.explain(step), after.batch(step), unique_stores, where)


def test_explain_names_the_file_and_index_of_a_foreign_format(tmp_path):
    """Raw .bin files (nanoGPT/OLMo style): the document's file, and its index in that file."""
    docs = unique_docs(120, 2, 5)
    for k, part in enumerate((docs[:50], docs[50:])):
        np.concatenate([np.append(d, EOS) for d in part]).astype(np.uint32).tofile(tmp_path / f"part-{k}.bin")
    src = dict(name="raw", path=str(tmp_path), dtype="uint32", eos_id=EOS, bos_id=BOS, strategy="bos_bestfit")
    p = Pipeline(DataConfig.from_dict(dict(sources=[src], seq_len=48, global_batch_size=4, seed=2)), 0, 1,
                 num_threads=0)
    seen = set()
    for step in range(10):
        batch = p.batch(step)
        for row, e in enumerate(p.explain(step)):
            for seg in e["segments"]:
                (lo, hi), (a, b) = seg["tokens"], seg["slots"]
                file_docs = np.fromfile(seg["file"], np.uint32)
                ends = np.flatnonzero(file_docs == EOS)
                starts = np.concatenate([[0], ends[:-1] + 1])
                own = file_docs[starts[seg["index_in_file"]] : ends[seg["index_in_file"]] + 1]
                assert np.array_equal(own[lo:hi], batch["inputs"][row, a:b])
                seen.add(seg["file"])
    assert seen == {str(tmp_path / "part-0.bin"), str(tmp_path / "part-1.bin")}


def test_decode_gives_the_text_with_the_stores_own_tokenizer(tmp_path):
    from conftest import make_texts, write_jsonl

    from forge_grain import prepare
    from forge_grain.tokenizer import load_tokenizer

    store = prepare(write_jsonl(tmp_path / "t.jsonl", make_texts(200, seed=1)), tmp_path / "s", progress=False)
    p = Pipeline(DataConfig.from_dict(dict(sources=[dict(name="t", path=str(store))], seq_len=64,
                                           global_batch_size=4)), 0, 1, num_threads=0)
    tok = load_tokenizer()
    batch = p.batch(2)
    for row, e in enumerate(p.explain(2, decode=True)):
        for seg in e["segments"]:
            a, b = seg["slots"]
            assert seg["text"] == tok.backend.decode(batch["inputs"][row, a:b].tolist(), skip_special_tokens=False)
    unknown = tmp_path / "raw.bin"
    np.concatenate(unique_docs(30, 2, 1)).astype(np.uint32).tofile(unknown)
    raw = Pipeline(DataConfig.from_dict(dict(sources=[dict(name="r", path=str(unknown), dtype="uint32")], seq_len=16,
                                             global_batch_size=2, num_epochs=1)), 0, 1, num_threads=0)
    with pytest.raises(Exception, match="records no tokenizer"):
        raw.explain(0, decode=True)


def test_batch_hash_is_the_same_on_any_shard_count_and_from_the_torch_bridge(unique_stores):
    cfg = config(unique_stores)
    one = Pipeline(cfg, 0, 1, num_threads=0)
    hashes = [one.batch_hash(step) for step in range(6)]
    assert len(set(hashes)) == 6
    for shards in (2, 4):
        parts = [Pipeline(cfg, k, shards, num_threads=0) for k in range(shards)]
        for step in range(6):
            joined = {k: np.concatenate([p.batch(step)[k] for p in parts]) for k in KEYS}
            assert hash_batch(joined) == hashes[step]
            assert parts[1].batch_hash(step) == hashes[step]  # any shard computes the global one
    torch = pytest.importorskip("torch")
    from forge_grain.bridges.torch import GrainIterableDataset

    for batch, expected in zip(GrainIterableDataset(cfg, rank=0, world_size=1), hashes):
        assert isinstance(batch["inputs"], torch.Tensor) and hash_batch(batch) == expected
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from forge_grain.bridges.jax import JaxIterator

    it = JaxIterator(Pipeline(cfg, 0, 1, num_threads=0), NamedSharding(Mesh(jax.devices(), ("data",)),
                                                                        PartitionSpec("data")))
    for expected in hashes:
        batch = next(it)
        assert isinstance(batch["inputs"], jax.Array) and hash_batch(batch) == expected
    it.close()


def test_the_command_line_explains_replays_and_hashes(tmp_path, unique_stores, capsys):
    toml = tmp_path / "data.toml"
    toml.write_text("seq_len = 64\nglobal_batch_size = 8\nseed = 11\n"
                    + "".join(f'[[sources]]\nname = "{n}"\npath = "{p}"\n' for n, p in unique_stores.items()))
    cfg = DataConfig.from_toml(toml)
    assert main(["explain", str(toml), "--step", "4", "--rank", "1", "--world-size", "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == Pipeline(cfg, 1, 2, num_threads=0).explain(4, shard=1)
    assert main(["explain", str(toml), "--step", "4"]) == 0
    text = capsys.readouterr().out
    assert "step 4, row 0" in text and "document" in text

    out = tmp_path / "batches.npz"
    assert main(["replay", str(toml), "--steps", "3:7", "--rank", "1", "--world-size", "2", "--out", str(out)]) == 0
    replayed = np.load(out)
    rank1 = Pipeline(cfg, 1, 2, num_threads=0)
    assert replayed["step"].tolist() == [3, 4, 5, 6]
    for i, step in enumerate(range(3, 7)):
        batch = rank1.batch(step)
        assert all(np.array_equal(replayed[k][i], batch[k]) for k in KEYS)

    capsys.readouterr()
    assert main(["hashes", str(toml), "--steps", "0:3"]) == 0
    lines = capsys.readouterr().out.split()
    whole = Pipeline(cfg, 0, 1, num_threads=0)
    assert lines == [x for step in range(3) for x in (str(step), whole.batch_hash(step))]


def check_streaming_rows(explained: list[dict], batch: dict, source, texts: list[str]) -> None:
    """Every segment is the tokens of the text at the stream row it names, at its slots; every
    slot is named (the texts tokenized independently of the packing)."""
    for row, e in enumerate(explained):
        covered = np.zeros(batch["inputs"].shape[1], bool)
        for seg in e["segments"]:
            (lo, hi), (a, b) = seg["tokens"], seg["slots"]
            tokens = source.tokenize([texts[seg["document"]]])[0]
            assert np.array_equal(batch["inputs"][row, a:b], tokens[lo:hi]), (e, seg)
            covered[a:b] = True
        assert np.array_equal(covered, batch["segment_ids"][row] > 0), e


@pytest.mark.parametrize("shards", [1, 2])
def test_a_streaming_row_is_explained_once_made(tmp_path, shards):
    from conftest import make_texts, write_jsonl

    texts = make_texts(300, seed=4, empty_every=23)
    write_jsonl(tmp_path / "t.jsonl", texts)
    cfg = DataConfig(sources=[dict(name="s", hf_dataset=str(tmp_path / "t.jsonl"), hf_streaming=True, window=40)],
                     seq_len=32, global_batch_size=4, canonical_streams=2)
    parts = [Pipeline(cfg, k, shards, num_threads=0, cache_dir=tmp_path / "cache") for k in range(shards)]
    assert all(r["segments"] is None for r in parts[0].explain(0))  # not read yet: not known
    seen = set()
    for step in range(25):
        for k, p in enumerate(parts):
            batch = p.batch(step)
            rows = p.explain(step, shard=k)
            assert {r["canonical_stream"] for r in rows} == ({0, 1} if shards == 1 else {k})
            check_streaming_rows(rows, batch, p.stores[0], texts)
            assert all(seg["file"] is None for r in rows for seg in r["segments"])  # `datasets` does not say
            seen |= {seg["document"] for r in rows for seg in r["segments"]}
    assert len(seen) > 40 and {d % 2 for d in seen} == {0, 1}  # rows r of stream r mod 2, both streams
    with pytest.raises(Exception, match="streaming: its tokens are not kept"):
        parts[0].explain(24, shard=0, decode=True)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_skipping_steps_at_resume_trains_the_rest_of_the_uninterrupted_stream(unique_stores, shards):
    cfg = config(unique_stores, phases=[{"start_step": 9, "weights": {"math": 0.8, "web": 0.2}}])
    a = Pipeline(cfg, 0, 1, num_threads=0)
    reference = [a.global_batch(step) for step in range(30)]
    parts = [Pipeline(cfg, k, shards, num_threads=0, resume_from=a.state_at(5), skip_steps=3) for k in range(shards)]
    iters = [p.iterator(a.state_at(5)) for p in parts]
    for step in range(5, 14):  # step s trains what the uninterrupted run trained at s + 3
        batches = [next(it) for it in iters]
        for k in KEYS:
            assert np.array_equal(np.concatenate([b[k] for b in batches]), reference[step + 3][k]), (step, k)
    b = parts[0]
    assert b.num_steps == a.num_steps - 3 and b.phase_at(6)["start_step"] == 9  # phases stay in the stream
    trained = sum(np.bincount(reference[s]["source_id"], minlength=3) for s in [*range(5), *range(8, 17)])
    assert [b.consumed(14)[n]["rows"] for n in ("web", "code", "math")] == trained.tolist()
    assert b.batch_hash(10) == a.batch_hash(13)
    check_rows(b.explain(10), reference[13], unique_stores, decoder(unique_stores))
    # a later plain resume, on another shard count, keeps the skip
    later = Pipeline(cfg, 0, 1, num_threads=0, resume_from=b.state_at(14))
    assert later.skips == [{"at_step": 5, "steps": 3}]
    assert np.array_equal(later.iterator(b.state_at(14)).__next__()["inputs"], reference[17]["inputs"])


def test_a_skip_then_a_mixture_change_repeat_and_lose_no_row(unique_stores):
    """Every source row up to the last one trained is either trained once or was in a skipped
    batch: nothing repeated, nothing lost, across a skip, a mixture change and a plain resume."""
    cfg = config(unique_stores)
    a = Pipeline(cfg, 0, 1, num_threads=0)
    b = Pipeline(cfg, 0, 2, num_threads=0, resume_from=a.state_at(4), skip_steps=2)
    changed = config(unique_stores)
    changed.sources[0].weight, changed.sources[2].weight = 0.1, 0.6
    c = Pipeline(changed, 0, 1, num_threads=0, resume_from=b.state_at(9), allow_mixture_change=True)
    d = Pipeline(changed, 0, 4, num_threads=0, resume_from=c.state_at(15))
    seen = [(e["source"], e["source_row"]) for p, steps in ((a, range(4)), (b, range(4, 9)), (c, range(9, 15)),
                                                            (d, range(15, 25))) for s in steps for e in p.explain(s)]
    skipped = [(e["source"], e["source_row"]) for s in (4, 5) for e in a.explain(s)]
    assert len(seen) == len(set(seen)) and not set(seen) & set(skipped)
    for name in ("web", "code", "math"):
        rows = sorted(r for n, r in seen + skipped if n == name)
        assert rows == list(range(len(rows))), name


def test_skip_steps_needs_a_state_of_this_config(unique_stores):
    cfg = config(unique_stores)
    with pytest.raises(Exception, match="skip_steps needs resume_from"):
        Pipeline(cfg, 0, 1, num_threads=0, skip_steps=2)
    other = config(unique_stores, seed=99)
    with pytest.raises(Exception, match="another config"):
        Pipeline(cfg, 0, 1, num_threads=0, resume_from=Pipeline(other, 0, 1, num_threads=0).state_at(3), skip_steps=2)


def holds(e: dict, skipped: dict) -> bool:
    return any(seg["document"] in skipped.get(e["source"], ()) for seg in e["segments"])


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_skipping_documents_trains_the_uninterrupted_rows_without_theirs(unique_stores, shards):
    """From the state's step on, the rows holding the skipped documents are gone in every
    epoch and the rest close up: the run trains the uninterrupted run's rows in order, less
    exactly those."""
    cfg = config(unique_stores, max_steps=70, phases=[{"start_step": 9, "weights": {"math": 0.8, "web": 0.2}}])
    a = Pipeline(cfg, 0, 1, num_threads=0)
    rows = [e for step in range(70) for e in a.explain(step)]  # the uninterrupted run, row by row
    later = rows[5 * 8:]
    skipped = {"web": sorted({later[3]["segments"][0]["document"], later[40]["segments"][-1]["document"]}),
               "math": [later[next(i for i, e in enumerate(later) if e["source"] == "math")]["segments"][0]["document"]]}
    kept = rows[:5 * 8] + [e for e in later if not holds(e, skipped)]
    assert len(kept) < len(rows) - 3
    math_epochs = {e["epoch"] for e in later if e["source"] == "math" and holds(e, skipped)}
    assert len(math_epochs) > 1  # the skipped math document comes again in a later epoch: gone there too

    state = a.state_at(5)
    parts = [Pipeline(cfg, k, shards, num_threads=0, resume_from=state, skip_documents=skipped) for k in range(shards)]
    b = parts[0]
    assert b.num_steps == len(kept) // 8
    iters = [p.iterator(state) for p in parts]
    where = decoder(unique_stores)
    for step in range(5, b.num_steps):
        parts_of_step = [next(it) for it in iters]
        batch = {k: np.concatenate([part[k] for part in parts_of_step]) for k in (*KEYS, "source_id")}
        want = kept[step * 8:(step + 1) * 8]
        got = b.explain(step)
        assert [(e["source"], e["source_row"]) for e in got] == [(e["source"], e["source_row"]) for e in want]
        assert [b.source_names[i] for i in batch["source_id"]] == [e["source"] for e in want]
        check_rows(got, batch, unique_stores, where)
        assert not any(holds(e, skipped) for e in got)
    assert b.batch_hash(5) == hash_batch(b.global_batch(5))
    trained = {n: sum(1 for e in kept[:30 * 8] if e["source"] == n) for n in ("web", "code", "math")}
    assert {n: c["rows"] for n, c in b.consumed(30).items()} == trained
    tokens = sum(int(b.global_batch(s)["loss_mask"].sum()) for s in range(30))
    assert sum(c["trained_tokens"] for c in b.consumed(30).values()) == tokens
    assert b.phase_at(4)["start_step"] == 0 and b.phase_at(20)["start_step"] == 9

    # a later plain resume, on another shard count, keeps the skip; a second skip adds to it
    plain = Pipeline(cfg, 1, 2, num_threads=0, resume_from=b.state_at(20))
    assert plain.skips == [{"at_step": 5, "documents": skipped}]
    assert [{**e, "shard": 0} for e in plain.explain(25)] == [{**e, "shard": 0} for e in b.explain(25)]
    more = Pipeline(cfg, 0, 1, num_threads=0, resume_from=b.state_at(20), skip_steps=2, skip_documents={"code": [0, 1]})
    assert [e["source_row"] for e in more.explain(19)] == [e["source_row"] for e in b.explain(19)]
    after = [e for e in kept[22 * 8:] if not (e["source"] == "code" and holds(e, {"code": [0, 1]}))]
    for step in range(20, 30):
        assert [(e["source"], e["source_row"]) for e in more.explain(step)] == \
            [(e["source"], e["source_row"]) for e in after[(step - 20) * 8:(step - 19) * 8]]


def test_skip_documents_is_checked(unique_stores):
    cfg = config(unique_stores)
    a = Pipeline(cfg, 0, 1, num_threads=0)
    with pytest.raises(Exception, match="skip_documents needs resume_from"):
        Pipeline(cfg, 0, 1, num_threads=0, skip_documents={"web": [1]})
    with pytest.raises(Exception, match="no source named 'blog'"):
        Pipeline(cfg, 0, 1, num_threads=0, resume_from=a.state_at(3), skip_documents={"blog": [1]})
    with pytest.raises(Exception, match="document 300 is not in .*300 documents"):
        Pipeline(cfg, 0, 1, num_threads=0, resume_from=a.state_at(3), skip_documents={"web": [300]})
    with pytest.raises(Exception, match="integers >= 0"):
        Pipeline(cfg, 0, 1, num_threads=0, resume_from=a.state_at(3), skip_documents={"web": ["7"]})
    b = Pipeline(cfg, 0, 1, num_threads=0, resume_from=a.state_at(3), skip_documents={"web": [4]})
    changed = config(unique_stores)
    changed.sources[0].weight = 0.9
    with pytest.raises(Exception, match="mixture change after skipped documents"):
        Pipeline(changed, 0, 1, num_threads=0, resume_from=b.state_at(6), allow_mixture_change=True)
    # the order that works: the change and the skip at one resume
    both = Pipeline(changed, 0, 1, num_threads=0, resume_from=a.state_at(3), allow_mixture_change=True,
                    skip_documents={"web": [4]})
    rows = [e for step in range(3, 40) for e in both.explain(step)]
    assert not any(holds(e, {"web": [4]}) for e in rows)
    plain = Pipeline(changed, 0, 1, num_threads=0, resume_from=a.state_at(3), allow_mixture_change=True)
    assert any(holds(e, {"web": [4]}) for step in range(3, 40) for e in plain.explain(step))
    assert both.explain(2) == plain.explain(2) == a.explain(2)


@pytest.mark.parametrize("window, chunk_docs", [(None, None), (3, 1000), (3, 5000)])
def test_positions_of_inverts_the_epoch_order(tmp_path, window, chunk_docs):
    """Where a plan row falls in an epoch, in closed form both ways: small epochs (an exact
    shuffle), large ones (a Feistel network) and the locality order of `shuffle_window`, its
    windows small (their shuffle built once and kept) and large (a Feistel network, each
    window's rows tabled once an eighth of them were read). Read a batch at a time, as a
    loader reads it (most batches in the window of the one before, some across two), the
    order is the same."""
    from forge_grain import pack

    docs = [np.arange(2, 2 + n) for n in np.random.default_rng(0).integers(1, 12, 9000)]
    store = write_store(tmp_path / "s", docs, vocab_size=100)
    for seq_len in (8, 64):  # > 4096 rows and < 4096 rows per epoch
        ds = pack(store, seq_len, "concat", cache_dir=tmp_path, chunk_docs=chunk_docs, shuffle_window=window,
                  num_epochs=3, progress=False)
        n = ds.num_rows
        assert (n > 4096) == (seq_len == 8)
        for e in (0, 2):  # (batches first: the first rows of a large window are found without its table)
            batches = [ds.rows_of(np.arange(a, min(a + 7, (e + 1) * n))) for a in range(e * n, (e + 1) * n, 7)]
            plan_rows = ds.rows_of(np.arange(e * n, (e + 1) * n))
            assert np.array_equal(ds.positions_of(plan_rows, e), np.arange(n))
            assert np.array_equal(np.concatenate(batches), plan_rows)


def test_replay_of_a_streaming_run_reads_from_its_saved_state(tmp_path, capsys):
    from conftest import make_texts, write_jsonl

    write_jsonl(tmp_path / "t.jsonl", make_texts(300, seed=2))
    toml = tmp_path / "s.toml"
    toml.write_text('seq_len = 32\nglobal_batch_size = 4\ncanonical_streams = 1\n'
                    f'[[sources]]\nname = "s"\nhf_dataset = "{tmp_path / "t.jsonl"}"\nhf_streaming = true\nwindow = 40\n')
    p = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0, progress=False)
    reference = [{k: v.copy() for k, v in p.batch(step).items()} for step in range(9)]
    explained = p.explain(6)  # made: recorded
    (tmp_path / "state.json").write_text(json.dumps(p.state_at(2)))
    assert main(["replay", str(toml), "--state", str(tmp_path / "state.json"), "--steps", "4:7",
                 "--out", str(tmp_path / "b.npz")]) == 0
    replayed = np.load(tmp_path / "b.npz")
    assert replayed["step"].tolist() == [4, 5, 6]
    assert all(np.array_equal(replayed[k][i], reference[4 + i][k]) for i in range(3) for k in KEYS)
    assert main(["replay", str(toml), "--state", str(tmp_path / "state.json"), "--steps", "1:3",
                 "--out", str(tmp_path / "c.npz")]) == 2
    assert "steps 1:3 start before the state's step 2" in capsys.readouterr().err
    # explain reads the steps from the state to the one asked: the same rows as the run made
    capsys.readouterr()
    assert main(["explain", str(toml), "--state", str(tmp_path / "state.json"), "--step", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == explained and explained[0]["segments"]
    assert main(["explain", str(toml), "--state", str(tmp_path / "state.json"), "--step", "6"]) == 0
    assert "canonical stream 0 window" in capsys.readouterr().out
    # hashes likewise: the steps made in order from the state's (it was refused: "no global batch")
    from forge_grain.pipeline.explain import hash_batch

    assert main(["hashes", str(toml), "--state", str(tmp_path / "state.json"), "--steps", "4:7"]) == 0
    assert capsys.readouterr().out.split() == [x for s in range(4, 7) for x in (str(s), hash_batch(reference[s]))]


def test_explain_decode_finds_the_stores_tokenizer_from_any_directory(tmp_path, monkeypatch):
    """A store prepared with `--tokenizer tok/bpe.json` from one directory is decoded from
    another (the path is recorded absolute); `--tokenizer PATH` decodes with a copy elsewhere,
    checked against the store's record; a store recorded relative (before) says what to pass."""
    import json
    import shutil

    from conftest import make_texts, write_jsonl

    from forge_grain import prepare
    from forge_grain.cli import main
    from forge_grain.tokenizer import DEFAULT_TOKENIZER

    (tmp_path / "work" / "tok").mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER, tmp_path / "work" / "tok" / "bpe.json")
    monkeypatch.chdir(tmp_path / "work")
    store = prepare(write_jsonl(tmp_path / "t.jsonl", make_texts(100, seed=2)), tmp_path / "s",
                    tokenizer="tok/bpe.json", progress=False)
    (tmp_path / "run.toml").write_text(f'seq_len = 64\nglobal_batch_size = 4\nnum_epochs = 1\n[[sources]]\n'
                                       f'name = "t"\npath = "{store}"\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["explain", str(tmp_path / "run.toml"), "--step", "1", "--decode", "--json"]) == 0
    shutil.move(tmp_path / "work" / "tok" / "bpe.json", tmp_path / "moved.json")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["tokenizer"]["path"] = "tok/bpe.json"  # as a store prepared before recorded it
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert main(["explain", str(tmp_path / "run.toml"), "--step", "1", "--decode"]) == 2
    assert main(["explain", str(tmp_path / "run.toml"), "--step", "1", "--tokenizer", str(tmp_path / "moved.json")]) == 0


def test_replay_writes_what_the_readme_says_with_and_without_a_batch_size_schedule(tmp_path):
    """`[steps, rows, seq_len]` per key; under a schedule the steps' rows one after another with
    `rows_per_step`. Either way the batches are the pipeline's."""
    from conftest import store, write_toml

    from forge_grain.cli import main

    stores = {"web": store(tmp_path / "web", 300, 1), "code": store(tmp_path / "code", 200, 2)}
    plain = write_toml(tmp_path / "plain.toml", stores)
    sched = write_toml(tmp_path / "sched.toml", stores, extra="batch_sizes = [[0, 4], [3, 8]]")
    for cfg, sizes in ((plain, [8, 8, 8, 8]), (sched, [4, 8, 8, 8])):
        out = tmp_path / f"{cfg.stem}.npz"
        assert main(["replay", str(cfg), "--steps", "2:6", "--out", str(out)]) == 0
        got = np.load(out)
        p = Pipeline(DataConfig.from_toml(cfg), 0, 1, num_threads=0)
        want = [p.batch(s)["inputs"] for s in range(2, 6)]
        if len(set(sizes)) == 1:
            assert got["inputs"].shape == (4, 8, 64) and "rows_per_step" not in got
            assert np.array_equal(got["inputs"], np.stack(want))
        else:
            assert got["inputs"].shape == (sum(sizes), 64) and got["rows_per_step"].tolist() == sizes
            assert np.array_equal(got["inputs"], np.concatenate(want))


def test_explain_lists_no_segment_that_fills_no_slot(unique_stores):
    """A document whose first token is only a row's last target (masked) holds no input slot:
    it is not listed as a segment of zero tokens (a newcomer read it as a bug)."""
    from forge_grain.packing.packed import PackedDataset

    p = Pipeline(config(unique_stores), 0, 1, num_threads=0)
    segments = [s for step in range(60) for e in p.explain(step) for s in e["segments"]]
    assert segments and all(s["slots"][1] > s["slots"][0] and s["tokens"][1] > s["tokens"][0] for s in segments)
    d = next(d for d in p.mixture.datasets if isinstance(d, PackedDataset))
    shown = [x[3] for r in range(d.num_rows) for x in d.plan.documents_of(r, d.store.offsets)]
    assert 0 in shown  # the plans do hold such documents: the test would see them listed
