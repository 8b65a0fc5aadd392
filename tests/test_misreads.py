"""The silent misreads of raw token files, each closed at its root: token files read with the
wrong width, a declared EOS/BOS that does not delimit the data, and the messages a new user
meets on the way. (Mixture changes at resume: tests/test_mixture_changes.py; every way in
at once: tests/test_ingestion_properties.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SLOW, write_jsonl

from forge_grain import DataConfig, Pipeline, PrepareError, StoreError, TokenStore, prepare
from forge_grain.cli import main as cli
from forge_grain.tokenizer import DEFAULT_TOKENIZER

# every size class of the audit (100k, 1M and 5M once passed unnoticed; 10k, 500k and 2^20 were
# caught), and odd sizes; 10^7 in the slow run
SIZES = [1_000, 999, 10_000, 77_777, 100_000, 500_000, 2**20, 1_000_000, 1_234_567, 5_000_000]
SIZES += [10_000_000] if SLOW else []
# (the width written, the width read): every narrower reading of a wider file
WRONG = [("int32", "uint16"), ("uint32", "uint16"), ("int64", "uint16"), ("int64", "uint32")]


def corpus(n: int, vocab: int, seed: int = 0, zeros: float = 0.0, eos: int = 1) -> np.ndarray:
    """n token ids of a Zipf-like distribution (as real text is), documents ending in `eos`,
    a fraction `zeros` of them id 0 (a tokenizer whose id 0 is common)."""
    rng = np.random.default_rng(seed)
    t = (rng.zipf(1.2, n) + 1) % vocab
    t[rng.random(n) < zeros] = 0
    t[t == eos] = 2
    t[rng.integers(20, 400, n // 20 + 1).cumsum()[: n // 200 + 1].clip(0, n - 1)] = eos
    t[-1] = eos
    return t


@pytest.fixture(scope="module")
def wide_files(tmp_path_factory):
    base = tmp_path_factory.mktemp("wide")
    files = {}
    for n in SIZES:
        t = corpus(n, 50_000, seed=n)
        for dtype in ("int32", "uint32", "int64"):
            files[n, dtype] = base / f"{dtype}-{n}.bin"
            t.astype(dtype).tofile(files[n, dtype])
    return files


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("written, read", WRONG)
def test_wider_ids_are_never_read_narrow(wide_files, n, written, read):
    f = wide_files[n, written]
    vocab = 50_000 if read == "uint16" else 100_000  # the vocabulary decides the width read
    bits = "64" if written == "int64" else "32"
    with pytest.raises(StoreError, match=rf"{f.name}: read as {read}, .*{bits}-bit ids read as"):
        TokenStore.open(f, eos_id=1, vocab_size=vocab)  # derived from the vocabulary
    with pytest.raises(StoreError, match=rf"{f.name}: read as {read}, .*{bits}-bit ids read as"):
        TokenStore.open(f, eos_id=1, dtype=read)  # declared, wrongly
    store = TokenStore.open(f, eos_id=1, dtype=written, vocab_size=vocab)
    assert store.num_tokens == n and store.dtype == np.dtype(written)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("zeros", [0.0, 0.1, 0.3])
def test_honest_16_bit_files_open_exactly_even_with_many_zeros(tmp_path, n, zeros):
    t = corpus(n, 50_000, seed=n + 1, zeros=zeros)
    t.astype(np.uint16).tofile(tmp_path / "t.bin")
    store = TokenStore.open(tmp_path / "t.bin", eos_id=1, vocab_size=50_000)
    assert store.dtype == np.uint16 and store.num_tokens == n
    assert np.array_equal(np.concatenate([store[i] for i in range(len(store))]), t)


@pytest.mark.parametrize("vocab", [100_000, 256_000])
def test_honest_32_bit_files_of_large_vocabularies_open(tmp_path, vocab):
    t = corpus(300_000, vocab, seed=vocab)
    t[::7] = np.random.default_rng(0).integers(65_536, vocab, len(t[::7]))  # ids past 16 bits too
    t[-1] = 1
    t.astype(np.uint32).tofile(tmp_path / "t.bin")
    for opts in (dict(vocab_size=vocab), dict(dtype="uint32")):
        store = TokenStore.open(tmp_path / "t.bin", eos_id=1, **opts)
        assert np.array_equal(np.concatenate([store[i] for i in range(len(store))]), t)


def test_16_bit_ids_declared_32_bit_are_refused(tmp_path):
    corpus(200_000, 50_000).astype(np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: read as uint32, .*16-bit ids read as 32-bit.*dtype='uint16'"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint32")
    with pytest.raises(StoreError, match=r"t\.bin: read as uint32, .*ids past vocab_size 50,000.*16-bit ids read"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint32", vocab_size=50_000)


def test_a_sample_that_cannot_tell_asks_for_the_dtype(tmp_path):
    """Few ids, every other 16-bit value zero: 32-bit ids, or 16-bit ids with odd zeros? A
    derived dtype asks; a declared one is taken at its word."""
    np.array([5, 1] * 8, np.int32).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: read as uint16 \(derived from the vocabulary\), the sample cannot "
                                         r"tell.*dtype='uint16' or 'int32'"):
        TokenStore.open(tmp_path / "t.bin", eos_id=1, vocab_size=1000)
    assert TokenStore.open(tmp_path / "t.bin", eos_id=1, dtype="int32").num_tokens == 16


def test_the_tokenizer_decides_the_width_with_the_same_checks(tmp_path):
    corpus(1_000_000, 8192).astype(np.int32).tofile(tmp_path / "t.bin")  # the shipped tokenizer: 8,192 ids
    with pytest.raises(StoreError, match=r"t\.bin: read as uint16, every other token is 0.*int32"):
        TokenStore.open(tmp_path / "t.bin", eos_id=1, tokenizer=str(DEFAULT_TOKENIZER))


def test_a_kempnerforge_job_over_int32_bin_files_is_refused_not_trained_on_zeros(tmp_path):
    (tmp_path / "data").mkdir()
    for k in range(3):
        corpus(1_000_000, 8192, seed=k).astype(np.int32).tofile(tmp_path / "data" / f"tokenized_{k:04d}.bin")
    (tmp_path / "job.toml").write_text(
        f'[data]\ndataset_path = "{tmp_path / "data"}"\nfile_pattern = "tokenized_*.bin"\n'
        f'tokenizer_path = "{DEFAULT_TOKENIZER}"\npack_sequences = true\n\n'
        "[train]\nseq_len = 64\nbatch_size = 2\nmax_steps = 10\n")
    with pytest.raises(StoreError, match=r"tokenized_0000\.bin: read as uint16, every other token is 0"):
        Pipeline(DataConfig.from_toml(tmp_path / "job.toml"), 0, 1, num_threads=0)


# -- 2. a declared EOS (BOS) must be the data's ------------------------------------------------


def test_a_declared_eos_that_is_not_the_datas_is_refused(tmp_path):
    t = corpus(400_000, 50_000)  # documents end with 1
    t.astype(np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: eos_id=5 was declared, but document \d+ does not end with it "
                                         r"\(it has 1\); check the id, or pass whole_documents=False"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint16", eos_id=5)
    store = TokenStore.open(tmp_path / "t.bin", dtype="uint16", eos_id=1)
    assert all(store[i][-1] == 1 for i in range(len(store)))


def test_a_delimiter_that_cuts_mostly_tiny_documents_is_refused(tmp_path):
    """A common token taken for EOS, in a file that happens to end with it."""
    rng = np.random.default_rng(0)
    t = np.where(rng.random(50_000) < 0.6, 0, rng.integers(2, 1000, 50_000))
    t[-1] = 0
    t.astype(np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: with eos_id=0, [\d,]+ of [\d,]+ documents are 1-2 tokens long "
                                         r"\(median 1\).*Check eos_id"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint16", eos_id=0)


def test_a_declared_bos_must_start_every_document(tmp_path):
    rng = np.random.default_rng(2)
    docs = [np.concatenate([[0], rng.integers(2, 100, rng.integers(3, 30)), [1]]) for _ in range(50)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: bos_id=7 was declared, but document 0 does not start with it"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint16", eos_id=1, bos_id=7)
    store = TokenStore.open(tmp_path / "t.bin", dtype="uint16", eos_id=1, bos_id=0)
    assert [store[i].tolist() for i in range(len(store))] == [d.tolist() for d in docs]


def test_files_cut_inside_a_document_are_declared_so(tmp_path):
    """OLMo-style shards may split a document across files: whole_documents=False (the
    source key, or `inspect --partial-documents`) exempts each file's first and last."""
    rng = np.random.default_rng(3)
    docs = [np.append(rng.integers(2, 100, rng.integers(3, 30)), 1) for _ in range(60)]
    flat = np.concatenate(docs).astype(np.uint16)
    (tmp_path / "d").mkdir()
    flat[: len(flat) // 2].tofile(tmp_path / "d" / "part-0.bin")
    flat[len(flat) // 2 :].tofile(tmp_path / "d" / "part-1.bin")
    with pytest.raises(StoreError, match=r"part-0\.bin: eos_id=1 was declared.*whole_documents=False"):
        TokenStore.open(tmp_path / "d", dtype="uint16", eos_id=1)
    store = TokenStore.open(tmp_path / "d", dtype="uint16", eos_id=1, whole_documents=False)
    assert store.num_tokens == len(flat)
    cfg = DataConfig.from_dict(dict(sources=[dict(name="d", path=str(tmp_path / "d"), dtype="uint16", eos_id=1,
                                                  vocab_size=100, whole_documents=False)],
                                    seq_len=16, global_batch_size=2))
    assert Pipeline(cfg, 0, 1, num_threads=0).stores[0].num_tokens == len(flat)
    assert cli(["inspect", str(tmp_path / "d"), "--dtype", "uint16", "--eos-id", "1", "--partial-documents"]) == 0
    with pytest.raises(Exception, match=r"whole_documents: must be true or false"):
        DataConfig.from_dict(dict(sources=[dict(name="d", path="x", whole_documents="no")], seq_len=8,
                                  global_batch_size=2))


# -- messages a new user meets ------------------------------------------------------------------


def test_pretokenized_rows_without_the_declared_eos_name_the_real_flag(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"ids": [5, 6, 7]}) + "\n" for _ in range(3)))
    with pytest.raises(PrepareError, match=r"does not end with EOS id 9.*pass --eos \(add_eos=True\)"):
        prepare(tmp_path / "in.jsonl", tmp_path / "out", token_field="ids", vocab_size=10, eos_id=9, progress=False)
    assert cli(["prepare", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--token-field", "ids",
                "--vocab-size", "10", "--eos-id", "9", "--eos", "-q"]) == 0


def test_prepare_of_a_token_store_says_it_is_one(tmp_path, corpus):
    store = prepare(corpus, tmp_path / "store", progress=False)
    with pytest.raises(PrepareError, match=r"store: is already a forge-grain token store.*TokenStore\.open"):
        prepare(store, tmp_path / "again", progress=False)


def test_a_config_file_is_recognised_and_summarised(tmp_path, bin_store, capsys):
    (tmp_path / "data.toml").write_text(
        f'seq_len = 32\nglobal_batch_size = 4\n[[sources]]\nname = "web"\npath = "{bin_store}"\n')
    with pytest.raises(StoreError, match=r"data\.toml: this is a TOML file \(a data config or a job file\?\).*"
                                         r"forge-grain inspect CONFIG\.toml"):
        TokenStore.open(tmp_path / "data.toml", dtype="uint16")
    assert cli(["inspect", str(tmp_path / "data.toml")]) == 0
    out = capsys.readouterr().out
    assert "a data config, 1 source(s), seq_len 32" in out and "source 'web'" in out and "documents   " in out


def test_our_own_caches_are_never_taken_for_data(tmp_path, monkeypatch):
    """.bin directories opened once with caches beside the data hold them in a hidden directory;
    a later pattern matching no token file must say what the directory holds, not blame the
    caches' files."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE_BESIDE_DATA", "1")
    (tmp_path / "d").mkdir()
    corpus(5_000, 1000).astype(np.uint16).tofile(tmp_path / "d" / "part-0.bin")
    TokenStore.open(tmp_path / "d", dtype="uint16", eos_id=1)
    assert (tmp_path / "d" / ".forge-grain").is_dir()  # the cache is there
    with pytest.raises(StoreError, match=r"d: no file matches file_pattern='\*\.npy', but the directory holds \.bin "
                                         r"token files: set file_pattern.*'\*\.bin'"):
        TokenStore.open(tmp_path / "d", dtype="uint16", eos_id=1, file_pattern="*.npy")
    write_jsonl(tmp_path / "d" / "notes.jsonl", ["x"])
    (tmp_path / "d" / "part-0.bin").unlink()
    with pytest.raises(StoreError, match=r"holds \.jsonl files, not token arrays"):  # the caches' .json not named
        TokenStore.open(tmp_path / "d", dtype="uint16", eos_id=1)


# -- a kernel cache is code: only a private directory is used --------------------------------------


def test_the_kernel_cache_directory_must_be_private(tmp_path):
    """numba loads pickled code from its cache: a directory another user made first (in /tmp),
    or one others can write, or a link, is refused; a new one is made 0700."""
    import os

    from forge_grain.paths import private_directory

    fresh = tmp_path / "fresh" / "numba"
    assert private_directory(fresh) and (fresh.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not private_directory(shared)
    (tmp_path / "link").symlink_to(fresh)
    assert not private_directory(tmp_path / "link")
    if os.getuid() == 0:  # as root the test can play the other user who planted the directory
        planted = tmp_path / "planted"
        planted.mkdir(mode=0o700)
        os.chown(planted, 12345, 12345)
        assert not private_directory(planted)


def test_a_full_fingerprint_is_a_source_key(tmp_path):
    """The README's remedy for a foreign file rewritten between sampled blocks: the state
    refuses the changed data when the source hashes every byte."""
    from forge_grain import ConfigError, StateError
    from forge_grain.stores import checks

    tokens = np.tile(np.array([5, 6, 7, 1], np.uint16), 1_200_000)  # 9.6 MB: sampled, not hashed whole
    tokens.tofile(tmp_path / "t.bin")
    cfg = lambda fp: DataConfig.from_dict(dict(  # noqa: E731
        sources=[dict(name="t", path=str(tmp_path / "t.bin"), dtype="uint16", eos_id=1, vocab_size=10,
                      **({"fingerprint": fp} if fp else {}))], seq_len=16, global_batch_size=2))
    state = Pipeline(cfg("full"), 0, 1, num_threads=0).state_at(3)
    sampled = Pipeline(cfg(None), 0, 1, num_threads=0).state_at(3)
    sampled_bytes = np.zeros(tokens.nbytes, bool)
    for off in checks.sample_offsets(tokens.nbytes):
        sampled_bytes[off : off + checks.SAMPLE_BLOCK_BYTES] = True
    for off in checks.probe_offsets(tokens.nbytes):
        sampled_bytes[off : off + checks.PROBE_BYTES] = True
    unseen = next(i for i in range(300_001, len(tokens), 4) if not sampled_bytes[2 * i : 2 * i + 2].any())
    tokens[unseen] = 9  # one token no block or probe reads, EOS positions unchanged
    tokens.tofile(tmp_path / "t.bin")
    with pytest.raises(StateError, match=r"source 't' \(.*t\.bin\): the data is not what the state was saved with"):
        Pipeline(cfg("full"), 0, 1, num_threads=0).iterator(state)
    Pipeline(cfg(None), 0, 1, num_threads=0).iterator(sampled)  # the documented limit of sampling
    with pytest.raises(ConfigError, match=r"sources\[0\]\.fingerprint: must be 'sampled' or 'full'"):
        cfg("every byte")


@pytest.mark.parametrize("name", ["empty.bin", "empty.npy", "dir/part-1.bin"])
def test_an_empty_token_file_is_refused_naming_it(tmp_path, name):
    """A raw file of no tokens (a write that failed) is not a store of 0 documents, alone or
    among other files."""
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    if name.endswith(".npy"):
        np.save(path, np.zeros(0, np.uint16))
    else:
        path.write_bytes(b"")
    if name.startswith("dir/"):
        np.array([5, 6, 1], np.uint16).tofile(tmp_path / "dir" / "part-0.bin")
    with pytest.raises(StoreError, match=rf"{path}: holds no tokens"):
        TokenStore.open(path.parent if name.startswith("dir/") else path, dtype="uint16", eos_id=1)
