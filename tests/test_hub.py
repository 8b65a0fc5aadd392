"""Tokenizers named as every Hugging Face user names them (`gpt2`, `org/name`, `org/name@rev`),
resolved through the Hugging Face cache as `transformers` does. This machine reaches no Hub:
the tests place snapshots in a temporary cache and run with `HF_HUB_OFFLINE=1`."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_texts, write_jsonl

from forge_grain import DataConfig, Pipeline, PrepareError, StateError, TokenStore, prepare
from forge_grain.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

REV_A = "a" * 40
REV_B = "b" * 40


def snapshot(cache, repo: str, rev: str, tokenizer_json: dict, main: bool = True):
    """`repo` at commit `rev` in the Hugging Face cache `cache` (HF_HOME), as `hf download`
    leaves it: models--org--name/snapshots/<rev>/..., refs/main -> rev."""
    base = cache / "hub" / f"models--{repo.replace('/', '--')}"
    folder = base / "snapshots" / rev
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|endoftext|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    if main:
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text(rev)
    return folder


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache / "hub"))  # (read once, at import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shipped = json.loads(DEFAULT_TOKENIZER.read_text())
    snapshot(cache, "acme/tiny-bpe", REV_A, shipped)
    return cache


def moved_main(cache):
    """`main` of acme/tiny-bpe moved to a commit whose tokenizer has one more token."""
    changed = json.loads(DEFAULT_TOKENIZER.read_text())
    top = max(t["id"] for t in changed["added_tokens"])
    changed["added_tokens"].append({**changed["added_tokens"][-1], "id": top + 1, "content": "<|new|>"})
    snapshot(cache, "acme/tiny-bpe", REV_B, changed)


def test_a_hub_name_loads_from_the_cache_pinned_to_its_commit(hf_cache):
    tok = load_tokenizer("acme/tiny-bpe")
    local = load_tokenizer(DEFAULT_TOKENIZER)
    assert tok.path == f"acme/tiny-bpe@{REV_A}"
    assert tok.sha256 == local.sha256 and (tok.bos_id, tok.eos_id) == (local.bos_id, local.eos_id)
    text = make_texts(20, seed=1)
    assert tok.encode_batch(text) == local.encode_batch(text)
    again = pickle.loads(pickle.dumps(tok))  # a worker process resolves the pinned name again
    assert again.path == tok.path and again.encode_batch(text) == tok.encode_batch(text)
    assert load_tokenizer(f"acme/tiny-bpe@{REV_A}").path == tok.path  # a revision, as from_pretrained(revision=)


def test_an_offline_miss_says_how_to_fetch_it_once(hf_cache):
    with pytest.raises(PrepareError, match=r"acme/missing: no local tokenizer of this name and not in the Hugging "
                                           r"Face cache .*HF_HUB_OFFLINE is set.*`hf download acme/missing "
                                           r"tokenizer\.json"):
        load_tokenizer("acme/missing")
    with pytest.raises(PrepareError, match=r"tok/bpe12\.json: tokenizer not found"):  # a path stays a path
        load_tokenizer("tok/bpe12.json")


def test_prepare_records_the_commit_and_refuses_a_moved_main(hf_cache, tmp_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", make_texts(300, seed=2))
    out = prepare(corpus, tmp_path / "store", tokenizer="acme/tiny-bpe", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["path"] == f"acme/tiny-bpe@{REV_A}"
    reference = prepare(corpus, tmp_path / "reference", progress=False)  # the same tokenizer, from its file
    assert all(np.array_equal(a, b) for a, b in zip(TokenStore.open(out), TokenStore.open(reference)))
    assert prepare(corpus, tmp_path / "store", tokenizer="acme/tiny-bpe", progress=False) == out  # complete: kept
    moved_main(hf_cache)
    with pytest.raises(PrepareError, match=r"store: already holds a token store prepared with other settings "
                                           r"\(differing: .*tokenizer"):
        prepare(corpus, tmp_path / "store", tokenizer="acme/tiny-bpe", progress=False)


def test_a_streaming_source_and_a_kempnerforge_job_take_hub_names(hf_cache, tmp_path):
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "train.jsonl", make_texts(200, seed=3))
    cfg = DataConfig(sources=[dict(name="t", hf_dataset=str(tmp_path / "corpus"), hf_streaming=True,
                                   tokenizer="acme/tiny-bpe")], seq_len=32, global_batch_size=2, max_steps=3)
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    state = p.state_at(0)
    assert len(list(p.iterator())) == 3
    moved_main(hf_cache)  # the resolved tokenizer changed: the state no longer matches
    with pytest.raises(StateError, match=r"source 't' .*: the data is not what the state was saved with .*tokenizer"):
        Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache").iterator(state)

    (tmp_path / "tok").mkdir()
    ids = [np.append(np.arange(5, 40), 1) for _ in range(50)]
    np.save(tmp_path / "tok" / "part.npy", np.concatenate(ids).astype(np.uint16))
    (tmp_path / "job.toml").write_text(
        f'[data]\ndataset_path = "{tmp_path / "tok"}"\ntokenizer_path = "acme/tiny-bpe@{REV_A}"\n'
        "pack_sequences = true\n[train]\nseq_len = 16\nbatch_size = 2\nmax_steps = 4\n")
    job = DataConfig.from_toml(tmp_path / "job.toml")
    assert job.sources[0].eos_id == load_tokenizer(DEFAULT_TOKENIZER).eos_id == 1


def test_a_local_directory_of_that_name_wins_over_the_hub(hf_cache, tmp_path, monkeypatch):
    """As `from_pretrained`: a local path is read before a Hub name is looked up."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-bpe").mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER, tmp_path / "acme" / "tiny-bpe" / "tokenizer.json")
    assert load_tokenizer("acme/tiny-bpe").path == str(tmp_path / "acme" / "tiny-bpe")  # recorded absolute


# -- what the cache gives stays inside it --------------------------------------------------------


def _repo(cache, repo="acme/tiny-bpe"):
    return cache / "hub" / f"models--{repo.replace('/', '--')}"


def _elsewhere(tmp_path):
    """A folder outside the cache holding a tokenizer with one more token: loading it would pass
    for the cached one."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    changed = json.loads(DEFAULT_TOKENIZER.read_text())
    changed["added_tokens"].append({**changed["added_tokens"][-1], "id": 99999, "content": "<|planted|>"})
    (other / "tokenizer.json").write_text(json.dumps(changed))
    return other


def test_a_revision_climbing_out_of_the_cache_is_refused_naming_it(hf_cache, tmp_path):
    """`org/tok@../../../some/dir/ref` read a ref file outside the cache and loaded what it
    named; a revision is a branch, a tag or a commit, and the name says which it is not."""
    other = _elsewhere(tmp_path)
    (other / "ref").write_text(REV_A)
    for bad in ["acme/tiny-bpe@" + "../" * 11 + str(other / "ref").lstrip("/"), "acme/tiny-bpe@/abs/ref",
                "acme/tiny-bpe@main/../x", "acme/tiny-bpe@v1/"]:
        with pytest.raises(PrepareError, match=r"is not a revision"):
            load_tokenizer(bad)
    assert load_tokenizer("acme/tiny-bpe@main").path == f"acme/tiny-bpe@{REV_A}"  # a branch name is one


@pytest.mark.parametrize("how", ["ref", "snapshot link", "file link"])
def test_a_cache_pointing_out_of_itself_is_refused(hf_cache, tmp_path, how):
    """refs/main holding an absolute path, a snapshot folder that is a link out of the cache, and
    a snapshot's tokenizer.json whose link leads outside `blobs/`: each was followed."""
    other, base = _elsewhere(tmp_path), _repo(hf_cache)
    folder = base / "snapshots" / REV_A
    if how == "ref":
        (base / "refs" / "main").write_text(str(other))
    elif how == "snapshot link":
        shutil.rmtree(folder)
        folder.symlink_to(other, target_is_directory=True)
    else:
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer.json").symlink_to(other / "tokenizer.json")
    with pytest.raises(PrepareError, match=r"acme/tiny-bpe: .*(not a commit's folder|outside the repository's cache)"):
        load_tokenizer("acme/tiny-bpe")


def test_a_blob_is_checked_against_its_hash_name(hf_cache):
    """As huggingface_hub lays out a file: a link from the snapshot into `blobs/<sha256>`. A blob
    whose content is not what its name says is refused (it was used, and caught only later by
    the recorded sha256)."""
    import hashlib

    base, data = _repo(hf_cache), DEFAULT_TOKENIZER.read_bytes()
    (base / "blobs").mkdir()
    blob = base / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    link = base / "snapshots" / REV_A / "tokenizer.json"
    link.unlink()
    link.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    assert load_tokenizer("acme/tiny-bpe").sha256 == load_tokenizer(DEFAULT_TOKENIZER).sha256
    blob.write_bytes(data.replace(b"<|endoftext|>", b"<|endoftexT|>"))
    with pytest.raises(PrepareError, match=r"blob [0-9a-f]{64} does not hold what its name"):
        load_tokenizer("acme/tiny-bpe")


def test_a_name_too_long_for_a_path_is_an_error_naming_it(hf_cache):
    with pytest.raises(PrepareError, match=r"a Hugging Face Hub name of 5000 characters"):
        load_tokenizer("a" * 5000)
