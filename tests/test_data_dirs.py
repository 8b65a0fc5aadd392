"""A user's data directories are left alone: opening and packing any format writes nothing
beside the data (every cache lives under FORGE_GRAIN_CACHE), so the peers' own globs read
what they read before. With FORGE_GRAIN_CACHE_BESIDE_DATA=1 the caches go beside the data,
under one hidden directory no token-file glob matches."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from mds_writer import write_mds
from test_formats import LITDATA, make_docs, write_arrow, write_megatron

from forge_grain import DataConfig, Pipeline, TokenStore, pack

GLOBS = ["*.npy", "*.bin", "*.idx", "*.arrow", "*.mds", "*.json", "**/*.npy", "**/*.bin"]


def listing(directory) -> list[str]:
    """Every entry under `directory`, hidden ones included."""
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, dirs, files in os.walk(directory) for name in dirs + files)


@pytest.fixture
def datasets(tmp_path):
    docs = make_docs(200, seed=7)
    (tmp_path / "megatron").mkdir()
    (tmp_path / "npy").mkdir()
    (tmp_path / "bin").mkdir()
    flat = np.concatenate(docs)
    for k, part in enumerate(np.array_split(flat, 2)):
        np.save(tmp_path / "npy" / f"part_{k:03d}.npy", part.astype(np.uint16))  # KempnerForge's shards
        part.astype(np.uint16).tofile(tmp_path / "bin" / f"tokenized_{k:04d}.bin")
    import shutil

    return {
        "npy": (tmp_path / "npy", dict(dtype="uint16", whole_documents=False)),
        "bin": (tmp_path / "bin", dict(dtype="uint16", whole_documents=False)),
        "megatron": (write_megatron(tmp_path / "megatron" / "c4", docs).parent, {}),
        "arrow": (write_arrow(tmp_path / "arrow", docs), {}),
        "litdata": (shutil.copytree(LITDATA / "dataset", tmp_path / "litdata"), {}),
        "mds": (write_mds(tmp_path / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs]), {}),
    }


def test_opening_and_packing_every_format_writes_nothing_beside_the_data(datasets, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    before = {name: listing(path) for name, (path, _) in datasets.items()}
    globs = {name: {g: sorted(glob.glob(str(path / g), recursive=True)) for g in GLOBS}
             for name, (path, _) in datasets.items()}
    for name, (path, options) in datasets.items():
        store = TokenStore.open(path, **options)
        for strategy in ("concat", "bestfit", "bos_bestfit" if store.bos_id is not None else "concat"):
            ds = pack(store, 32, strategy)
            ds.get_batch(np.arange(min(4, ds.num_rows)))
        TokenStore.open(path, **options)  # the second open reads its caches
    sources = [dict(name=name, path=str(path), strategy="bestfit", **options)
               for name, (path, options) in datasets.items() if name in ("npy", "megatron")]
    p = Pipeline(DataConfig(sources=sources, seq_len=32, global_batch_size=4, max_steps=3), 0, 1, num_threads=0)
    list(p.iterator())
    for name, (path, _) in datasets.items():
        assert listing(path) == before[name], name
        assert {g: sorted(glob.glob(str(path / g), recursive=True)) for g in GLOBS} == globs[name], name
    assert list((tmp_path / "cache").rglob("*"))  # the caches are there instead


def test_kempnerforges_glob_reads_the_same_samples_after_forge_grain_opened_the_files(datasets, tmp_path,
                                                                                       monkeypatch):
    """KempnerForge's MemoryMappedDataset takes `sorted(glob(data_dir / "*.npy"))`: a cache
    written there once doubled as token data (195 samples became 199, sample 0 offsets)."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    path, options = datasets["npy"]
    files = sorted(path.glob("*.npy"))
    TokenStore.open(path, **options, eos_id=1)
    pack(TokenStore.open(path, **options), 32, "concat")
    assert sorted(path.glob("*.npy")) == files


def test_caches_beside_the_data_sit_in_one_hidden_directory_when_asked(datasets, tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FORGE_GRAIN_CACHE_BESIDE_DATA", "1")
    path, options = datasets["bin"]
    before = set(os.listdir(path))
    globs = {g: sorted(glob.glob(str(path / g), recursive=True)) for g in GLOBS}
    pack(TokenStore.open(path, **options, eos_id=1), 32, "bestfit")
    assert set(os.listdir(path)) - before == {".forge-grain"}
    assert {g: sorted(glob.glob(str(path / g), recursive=True)) for g in GLOBS} == globs
    hidden = listing(path / ".forge-grain")
    assert any(f.startswith("plans/") for f in hidden) and any(f.startswith("index/") for f in hidden)
    assert not [f for f in hidden if f.endswith((".npy", ".bin", ".idx", ".arrow", ".mds"))]
