"""`forge-grain prepare`: determinism, atomic resume after a crash, inputs, tokenizers, bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import expected_documents, make_texts, tree_bytes, write_jsonl

from forge_grain import PrepareError, TokenStore, prepare
from forge_grain.preparation import local as preparation
from forge_grain.tokenizer import DEFAULT_TOKENIZER


def test_same_inputs_give_byte_identical_stores_at_any_process_count(tmp_path, corpus):
    a = prepare(corpus, tmp_path / "a", num_shards=4, num_proc=1, progress=False)
    b = prepare(corpus, tmp_path / "b", num_shards=4, num_proc=2, progress=False)
    assert tree_bytes(a) == tree_bytes(b)
    assert sorted(tree_bytes(a)) == ["manifest.json"] + [
        f"shard-{i:05d}.{ext}" for i in range(4) for ext in ("bin", "idx.npy")
    ] + ["shards.idx.npy"]


def test_interrupted_run_rerun_equals_one_clean_run(tmp_path, corpus, monkeypatch):
    clean = prepare(corpus, tmp_path / "clean", num_shards=4, progress=False)
    real = preparation._documents

    def crash_in_shard_2(ds, tok, job, start, stop):
        for batch in real(ds, tok, job, start, stop):
            if start == 200:  # shard 2 of 4 over 400 rows
                raise KeyboardInterrupt("killed mid-shard")
            yield batch

    monkeypatch.setattr(preparation, "_documents", crash_in_shard_2)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, num_shards=4, progress=False)
    assert not (out / "manifest.json").exists()
    with pytest.raises(Exception, match="incomplete"):
        TokenStore.open(out)
    # what a SIGKILL leaves: a half-written temporary
    (out / ".shard-00002.bin.tmp-999999").write_bytes(b"\x07" * 11)
    monkeypatch.setattr(preparation, "_documents", real)
    done_before = (out / "shard-00000.bin").stat().st_mtime_ns
    prepare(corpus, out, num_shards=4, progress=False)
    assert (out / "shard-00000.bin").stat().st_mtime_ns == done_before  # finished shards were kept
    assert tree_bytes(out) == tree_bytes(clean)


def test_sigkilled_prepare_completes_on_rerun(tmp_path):
    corpus = write_jsonl(tmp_path / "big.jsonl", make_texts(30_000, seed=5))
    cmd = [sys.executable, "-m", "forge_grain", "prepare", str(corpus), str(tmp_path / "out"), "--num-shards", "12", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((tmp_path / "out").glob("shard-*.done.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if (tmp_path / "out" / "manifest.json").exists():
        pytest.skip("prepare finished before it could be killed")
    subprocess.run(cmd, check=True)
    clean = prepare(corpus, tmp_path / "clean", num_shards=12, progress=False)
    assert tree_bytes(tmp_path / "out") == tree_bytes(clean)


def test_rerun_with_same_arguments_is_a_no_op(tmp_path, corpus):
    out = prepare(corpus, tmp_path / "s", num_shards=2, progress=False)
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    prepare(corpus, out, num_shards=2, progress=False)
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamp


def test_other_settings_into_an_existing_store_need_overwrite(tmp_path, corpus, texts, reference_tokenizer):
    out = prepare(corpus, tmp_path / "s", num_shards=2, progress=False)
    with pytest.raises(PrepareError, match=r"already holds a token store.*--overwrite"):
        prepare(corpus, out, num_shards=2, add_eos=False, progress=False)
    prepare(corpus, out, num_shards=3, add_eos=False, overwrite=True, progress=False)
    store = TokenStore.open(out, verify=True)
    assert [store[i].tolist() for i in range(len(store))] == expected_documents(reference_tokenizer, texts, eos=None)
    assert len(store.files) == 3 and not list(out.glob("*.done.json"))


def test_text_files_are_one_document_each(tmp_path, reference_tokenizer):
    texts = make_texts(12, seed=9)
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(t)
    store = TokenStore.open(prepare(tmp_path / "txt", tmp_path / "s", progress=False))
    assert sorted(store[i].tolist() for i in range(len(store))) == sorted(expected_documents(reference_tokenizer, texts))


def test_parquet_and_saved_dataset_inputs(tmp_path, texts, reference_tokenizer):
    import datasets

    ds = datasets.Dataset.from_dict({"body": texts})
    ds.to_parquet(tmp_path / "c.parquet")
    ds.save_to_disk(tmp_path / "saved")
    expected = expected_documents(reference_tokenizer, texts)
    for src in (tmp_path / "c.parquet", tmp_path / "saved"):
        store = TokenStore.open(prepare(src, tmp_path / f"s-{src.name}", text_field="body", progress=False))
        assert [store[i].tolist() for i in range(len(store))] == expected


def test_hugging_face_tokenizer_directory(tmp_path, corpus, texts):
    from transformers import PreTrainedTokenizerFast

    from forge_grain.tokenizer import DEFAULT_TOKENIZER

    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_TOKENIZER), bos_token="<|bos|>", eos_token="<|endoftext|>")
    hf.save_pretrained(tmp_path / "tok")
    store = TokenStore.open(prepare(corpus, tmp_path / "s", tokenizer=tmp_path / "tok", progress=False))
    expected = [[hf.bos_token_id] + hf(t, add_special_tokens=False)["input_ids"] + [hf.eos_token_id] for t in texts if t]
    assert [store[i].tolist() for i in range(len(store))] == expected
    assert store.tokenizer["sha256"] == TokenStore.open(prepare(corpus, tmp_path / "s2", progress=False)).tokenizer["sha256"]


def test_manifest_records_counts_tokenizer_and_options(bin_store, texts):
    store = TokenStore.open(bin_store)
    m = store.manifest
    assert m.num_documents == len(store) == sum(1 for t in texts if t)
    assert m.source["skipped_empty"] == sum(1 for t in texts if not t)
    assert m.tokenizer["vocab_size"] == 8192 and len(m.tokenizer["sha256"]) == 64
    assert sum(s.num_tokens for s in m.shards) == store.num_tokens


# -- bad input --------------------------------------------------------------------------------


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PrepareError, match=r"empty\.jsonl.*empty"):
        prepare(tmp_path / "empty.jsonl", tmp_path / "s", progress=False)


def test_corpus_of_empty_documents(tmp_path):
    corpus = write_jsonl(tmp_path / "blank.jsonl", ["", "", ""])
    with pytest.raises(PrepareError, match=r"blank\.jsonl.*every document is empty"):
        prepare(corpus, tmp_path / "s", progress=False)
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_missing_text_field(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts, field="content")
    with pytest.raises(PrepareError, match=r"c\.jsonl.*no text field 'text'.*content"):
        prepare(corpus, tmp_path / "s", progress=False)


def test_dataset_name_that_cannot_be_reached_fails_fast(tmp_path):
    t0 = time.time()
    with pytest.raises(PrepareError, match="forge-grain-missing/no-such-dataset"):
        prepare("forge-grain-missing/no-such-dataset", tmp_path / "s", progress=False)
    assert time.time() - t0 < 60  # an error, not a hang


def test_unknown_special_token_and_missing_tokenizer(tmp_path, corpus):
    with pytest.raises(PrepareError, match=r"BOS token '<nope>' is not in"):
        prepare(corpus, tmp_path / "s", bos_token="<nope>", progress=False)
    with pytest.raises(PrepareError, match=r"missing\.json.*not found"):
        prepare(corpus, tmp_path / "s", tokenizer=tmp_path / "missing.json", progress=False)


# -- command line -----------------------------------------------------------------------------


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge_grain", *map(str, args)], capture_output=True, text=True)


def test_cli_prepare_and_inspect(tmp_path, corpus):
    r = run_cli("prepare", corpus, tmp_path / "s", "--layout", "arrayrecord", "--num-proc", "2", "--num-shards", "2")
    assert r.returncode == 0, r.stderr
    assert "documents   392" in r.stdout
    r = run_cli("inspect", tmp_path / "s", "--verify", "--plot", tmp_path / "len.png")
    assert r.returncode == 0, r.stderr
    assert "arrayrecord" in r.stdout and "verified" in r.stdout and "p50=" in r.stdout
    assert (tmp_path / "len.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_bad_input_without_a_traceback(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    r = run_cli("inspect", tmp_path / "t.bin", "--dtype", "uint16")
    assert r.returncode == 2
    assert "t.bin" in r.stderr and "not a multiple" in r.stderr and "Traceback" not in r.stderr


def _metaspace_tokenizer(path, texts):
    """A small SentencePiece-style tokenizer: Metaspace marks the start of every text it encodes,
    so no cut inside a document is safe and long documents must be encoded whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(path))
    return path


@pytest.mark.parametrize("tokenizer", ["shipped", "metaspace"])
def test_long_documents_are_tokenized_in_pieces_with_the_same_ids(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    texts = make_texts(3000, seed=4)
    long_doc = "".join(texts)  # ~300k characters: hundreds of 1,024-character pieces
    src = write_jsonl(tmp_path / "c.jsonl", ["short one", long_doc, "short two"])
    path = None if tokenizer == "shipped" else _metaspace_tokenizer(tmp_path / "meta.json", texts)
    kw = {} if path is None else {"tokenizer": path, "bos_token": "<s>", "eos_token": "</s>"}
    store = TokenStore.open(prepare(src, tmp_path / "s", piece_chars=1024, progress=False, **kw))
    ref = Tokenizer.from_file(str(path or DEFAULT_TOKENIZER))
    ref.encode_special_tokens = True
    assert store[1][1:-1].tolist() == ref.encode(long_doc, add_special_tokens=False).ids
    assert store[0][1:-1].tolist() == ref.encode("short one", add_special_tokens=False).ids


def test_the_command_line_says_its_version_and_that_a_finished_prepare_is_complete(tmp_path, capsys):
    """`forge-grain --version`; a re-run of a finished `prepare` says it is complete instead of
    printing the summary as if it had worked; the package is typed (py.typed)."""
    import forge_grain
    from forge_grain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"forge-grain {forge_grain.__version__}"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(40)))
    assert main(["prepare", str(corpus), str(tmp_path / "out"), "--quiet"]) == 0
    assert "already complete" not in capsys.readouterr().out
    assert main(["prepare", str(corpus), str(tmp_path / "out")]) == 0
    assert f"{tmp_path / 'out'}: already complete" in capsys.readouterr().out
    assert (Path(forge_grain.__file__).parent / "py.typed").exists()
