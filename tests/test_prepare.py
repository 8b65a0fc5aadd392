"""`forge-grain prepare`: determinism, atomic resume after a crash, inputs, tokenizers, bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import expected_documents, make_texts, tree_bytes, write_jsonl

from forge_grain import PrepareError, TokenStore, prepare
from forge_grain.preparation import local as preparation
from forge_grain.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


def test_same_inputs_give_byte_identical_stores_at_any_process_count(tmp_path, corpus):
    a = prepare(corpus, tmp_path / "a", num_shards=4, num_proc=1, progress=False)
    b = prepare(corpus, tmp_path / "b", num_shards=4, num_proc=2, progress=False)
    assert tree_bytes(a) == tree_bytes(b)
    assert sorted(tree_bytes(a)) == ["manifest.json"] + [
        f"shard-{i:05d}.{ext}" for i in range(4) for ext in ("bin", "idx.npy")
    ] + ["shards.idx.npy"]


def test_interrupted_run_rerun_equals_one_clean_run(tmp_path, corpus, monkeypatch):
    clean = prepare(corpus, tmp_path / "clean", num_shards=4, progress=False)
    real = preparation.documents

    def crash_in_shard_2(ds, tok, job, start, stop):
        for batch in real(ds, tok, job, start, stop):
            if start == 200:  # shard 2 of 4 over 400 rows
                raise KeyboardInterrupt("killed mid-shard")
            yield batch

    monkeypatch.setattr(preparation, "documents", crash_in_shard_2)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, num_shards=4, progress=False)
    assert not (out / "manifest.json").exists()
    with pytest.raises(Exception, match="incomplete"):
        TokenStore.open(out)
    # what a SIGKILL leaves: a half-written temporary
    (out / ".shard-00002.bin.tmp-999999").write_bytes(b"\x07" * 11)
    monkeypatch.setattr(preparation, "documents", real)
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


# -- EOS and BOS, named anywhere --------------------------------------------------------------


def _chat_style_tokenizer(directory, specials, config=None):
    """A trained BPE tokenizer whose special tokens are `specials`, saved as `tokenizer.json`
    (and a `tokenizer_config.json` holding `config`, where given), as a user's own would be."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(make_texts(200), trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def _without_transformers(code: str) -> subprocess.CompletedProcess:
    """`code` in a process where `import transformers` fails, as without the `[hf]` extra."""
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['transformers'] = None\n" + code],
                          capture_output=True, text=True)


def test_eos_and_bos_by_their_usual_names_and_by_the_tokenizers_config(tmp_path):
    plain = _chat_style_tokenizer(tmp_path / "plain", ["<|bos|>", "<|eos|>", "<|pad|>"])
    odd = _chat_style_tokenizer(tmp_path / "odd", ["<|im_start|>", "<|im_end|>"],
                                {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}})
    for where in (tmp_path / "plain", tmp_path / "plain" / "tokenizer.json"):
        r = _without_transformers(f"from forge_grain.tokenizer import load_tokenizer\n"
                                  f"t = load_tokenizer({str(where)!r}); print(t.bos_id, t.eos_id)")
        assert r.stdout.split() == [str(plain.token_to_id("<|bos|>")), str(plain.token_to_id("<|eos|>"))], r.stderr
    for where in (tmp_path / "odd", tmp_path / "odd" / "tokenizer.json"):  # named only by tokenizer_config.json
        r = _without_transformers(f"from forge_grain.tokenizer import load_tokenizer\n"
                                  f"t = load_tokenizer({str(where)!r}); print(t.bos_id, t.eos_id)")
        assert r.stdout.split() == [str(odd.token_to_id("<|im_start|>")), str(odd.token_to_id("<|im_end|>"))], \
            r.stderr
    (tmp_path / "odd" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "bos_tok')  # cut short
    with pytest.raises(PrepareError, match=r"odd/tokenizer_config\.json: cannot read it as JSON"):
        load_tokenizer(tmp_path / "odd" / "tokenizer.json")
    (tmp_path / "odd" / "tokenizer_config.json").write_text('{"eos_token": 7}')  # a wrong type: not guessed past
    with pytest.raises(PrepareError, match=r"odd/tokenizer_config\.json: eos_token is 7, not a token's string"):
        load_tokenizer(tmp_path / "odd" / "tokenizer.json")
    (tmp_path / "odd" / "tokenizer_config.json").write_text('["<|im_end|>"]')
    with pytest.raises(PrepareError, match=r"odd/tokenizer_config\.json: not a tokenizer config"):
        load_tokenizer(tmp_path / "odd" / "tokenizer.json")
    (tmp_path / "odd" / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": null}')  # as HF writes
    assert load_tokenizer(tmp_path / "odd" / "tokenizer.json").eos_id is None  # no usual name in its vocabulary


def test_a_config_source_names_its_eos_and_bos(tmp_path, monkeypatch):
    from forge_grain import ConfigError, DataConfig, Pipeline

    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    tok = _chat_style_tokenizer(tmp_path / "tok", ["<|begin|>", "<|end|>"])
    docs = write_jsonl(tmp_path / "docs.jsonl", make_texts(60, seed=2))
    src = dict(name="chat", hf_dataset="json", hf_data_files=str(docs), tokenizer=str(tmp_path / "tok"))
    cfg = dict(seq_len=64, global_batch_size=2)
    with pytest.raises(PrepareError, match=r"no EOS id known; name one \(--eos-token TOKEN, or eos_token in a config"):
        Pipeline(DataConfig.from_dict(dict(sources=[dict(src, bos_token="<|begin|>")], **cfg)), 0, 1, num_threads=0)
    named = dict(src, bos_token="<|begin|>", eos_token="<|end|>")
    for streaming in (False, True):
        pipe = Pipeline(DataConfig.from_dict(dict(sources=[dict(named, hf_streaming=streaming)], **cfg)), 0, 1,
                        num_threads=0)
        batch = pipe.batch(0)
        tokens = np.concatenate([batch["inputs"], batch["targets"]])
        assert tok.token_to_id("<|begin|>") in tokens and tok.token_to_id("<|end|>") in tokens, streaming
    with pytest.raises(ConfigError, match=r"sources\[0\]\.eos_token: a token's string"):
        DataConfig.from_dict(dict(sources=[dict(src, eos_token=7)], **cfg))
    with pytest.raises(PrepareError, match=r"EOS token '<\|nope\|>' is not in the tokenizer's vocabulary"):
        Pipeline(DataConfig.from_dict(dict(sources=[dict(named, eos_token="<|nope|>")], **cfg)), 0, 1, num_threads=0)


def test_a_code_corpus_with_test_files_prepares_from_a_directory_and_a_glob(tmp_path):
    """A directory or a glob the user names is the user's files: `test_io.py`, `eval.py` and
    `train.py` in a code corpus are code, not splits (they were refused as "named for splits")."""
    code = {"pkg/io.py": "def read(path):\n    return open(path).read()\n",
            "pkg/test_io.py": "def test_read(tmp_path):\n    assert read\n",
            "tests/test_cli.py": "import subprocess\n", "eval.py": "print('eval')\n", "train.py": "loop = 1\n"}
    for name, text in code.items():
        (tmp_path / "pysrc" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pysrc" / name).write_text(text)
    for k, source in enumerate([tmp_path / "pysrc", f"{tmp_path}/pysrc/**/*.py"]):
        store = TokenStore.open(prepare(source, tmp_path / f"s{k}", progress=False))
        assert len(store) == len(code), source
        assert sum(store.lengths) > sum(map(len, code.values())) // 8
    r = run_cli("prepare", tmp_path / "pysrc", tmp_path / "s-cli")
    assert r.returncode == 0 and "documents   5" in r.stdout, r.stderr
    # a Hub-style dataset directory (rows in JSON Lines) still follows the split names, and its
    # message offers a glob, which then takes the files as named
    rows = tmp_path / "hub"
    rows.mkdir()
    write_jsonl(rows / "train.jsonl", ["a training row"] * 3)
    write_jsonl(rows / "extra.jsonl", ["another row"] * 2)
    with pytest.raises(PrepareError, match=r"named for splits \['train'\] and others for none \(extra\.jsonl\).*a glob"):
        prepare(rows, tmp_path / "s-hub", progress=False)
    assert len(TokenStore.open(prepare(f"{rows}/*.jsonl", tmp_path / "s-glob", progress=False))) == 5
