"""KempnerForge's dataset classes, with their signatures, outputs and state keys, backed by forge-grain.

A KempnerForge training loop switches by its import line:

    from bridges.kempnerforge import MemoryMappedDataset, HuggingFaceDataset, StreamingHuggingFaceDataset, MixtureDataset

Each sample is `{"input_ids", "labels"}` (int64), as in KempnerForge: `MemoryMappedDataset`
gives `seq_len - 1` of each (a window of `seq_len` tokens, shifted), the Hugging Face
classes `seq_len` (a chunk of `seq_len + 1`). With `pack_sequences=True` documents are
known (by `eos_token_id`, or the tokenizer's EOS), a label that would cross into another
document is -100, and `segment_ids` / `position_ids` come along for document masking.
`MixtureDataset` adds `dataset_idx`.

What is exact here that KempnerForge approximates:
- raw `.bin` files are read with a declared dtype (`dtype=`, or `vocab_size=`), never one
  guessed from the file size; every file is validated as `TokenStore.open` validates it;
- rows are a forge-grain concat plan (documents in a seeded order, cut into rows; no
  file's tail is dropped), so each token after the first is a label exactly once;
- map-style classes resume exactly through the sampler (their state is only `epoch`, as
  in KempnerForge); the streaming class resumes exactly from its `forge_grain` state key
  (KempnerForge skips documents and loses its packing buffer), for the same rank and
  world size, and its epochs reshuffle with new window seeds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from bridges.torch import IGNORE_INDEX
from forge_grain import DataConfig, Pipeline, SourceConfig, TokenStore, pack


def _sample(row: dict, pack_sequences: bool) -> dict[str, torch.Tensor]:
    """One packed row (1-D arrays) as KempnerForge's sample; with `pack_sequences`, labels that
    cross into another document are -100 and the document layout comes along."""
    out = {"input_ids": torch.from_numpy(row["inputs"].astype(np.int64)),
           "labels": torch.from_numpy(row["targets"].astype(np.int64))}
    if pack_sequences:
        out["labels"] = torch.where(torch.from_numpy(np.ascontiguousarray(row["loss_mask"])), out["labels"],
                                    IGNORE_INDEX)
        out["segment_ids"] = torch.from_numpy(row["segment_ids"].astype(np.int64))
        out["position_ids"] = torch.from_numpy(row["positions"].astype(np.int64))
        # KempnerForge's key for its document attention mask (train.py reads batch["doc_ids"]): each input
        # token's document, counted from 0 in the sample
        out["doc_ids"] = out["segment_ids"] - out["segment_ids"][0]
    return out


class _PackedRows(Dataset):
    """Rows of a concat-packed token store as KempnerForge samples (shared by the map-style classes)."""

    def __init__(self, store: TokenStore, row_len: int, pack_sequences: bool, seed: int = 0):
        self.store, self.pack_sequences = store, pack_sequences
        self._rows = pack(store, row_len, "concat", seed=seed, shuffle=False, num_epochs=1)
        self._epoch = 0

    def __len__(self) -> int:
        return self._rows.num_rows

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"Index {idx} out of range [0, {len(self)})")
        return _sample(self._rows[int(idx)], self.pack_sequences)

    def close(self) -> None:
        """Release the store's memory maps (KempnerForge's way to end a dataset; not read after)."""
        self.store.close()


class MemoryMappedDataset(_PackedRows):
    """Pre-tokenized `.npy`/`.bin` files in `data_dir` (KempnerForge's signature).

    `dtype=` (or `vocab_size=`) declares raw `.bin` files; `.npy` files carry theirs.
    `pack_sequences=True` needs `eos_token_id` (documents end with it).
    """

    def __init__(self, data_dir: str, seq_len: int, file_pattern: str = "*.npy", pack_sequences: bool = False,
                 eos_token_id: int | None = None, *, dtype: str | None = None, vocab_size: int | None = None,
                 seed: int = 0):
        if pack_sequences and eos_token_id is None:
            raise ValueError("pack_sequences=True needs eos_token_id: the id that ends each document")
        store = TokenStore.open(data_dir, file_pattern=file_pattern, dtype=dtype, vocab_size=vocab_size,
                                **({"eos_id": eos_token_id, "whole_documents": False} if pack_sequences else {}))
        super().__init__(store, seq_len - 1, pack_sequences, seed)

    def state_dict(self) -> dict:
        """Keys: `epoch`, `total_samples` (as KempnerForge)."""
        return {"epoch": self._epoch, "total_samples": len(self)}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state.get("epoch", 0)


def _hf_source(dataset_name, split, text_field, tokenizer_path, dataset_config, **kw) -> SourceConfig:
    # KempnerForge's packing: documents end with EOS and start without BOS
    return SourceConfig(name="kempnerforge-hf", hf_dataset=dataset_name, hf_config=dataset_config, split=split,
                        text_field=text_field, tokenizer=tokenizer_path, add_bos=False, add_eos=True,
                        strategy="concat", **kw)


class HuggingFaceDataset(_PackedRows):
    """A Hugging Face dataset, tokenized once into a cached forge-grain store (KempnerForge's signature)."""

    def __init__(self, dataset_name: str, split: str, text_field: str, seq_len: int, tokenizer_path: str,
                 dataset_config: str | None = None, pack_sequences: bool = False, *, cache_dir=None, seed: int = 0):
        from forge_grain.hf import eager_store

        src = _hf_source(dataset_name, split, text_field, tokenizer_path, dataset_config)
        super().__init__(TokenStore.open(eager_store(src, cache_dir, progress=False)), seq_len, pack_sequences, seed)
        self._sample_idx = 0

    def state_dict(self) -> dict:
        """Keys: `epoch`, `sample_idx`, `total_sequences` (as KempnerForge)."""
        return {"epoch": self._epoch, "sample_idx": self._sample_idx, "total_sequences": len(self)}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state.get("epoch", 0)
        self._sample_idx = state.get("sample_idx", 0)


class StreamingHuggingFaceDataset(IterableDataset):
    """A streaming Hugging Face dataset for one rank (KempnerForge's signature): tokenized on the
    fly and packed `shuffle_buffer_size` documents at a time by forge-grain's streaming source.

    `state_dict()` has KempnerForge's keys (`epoch`, `rank_docs_consumed`: documents dealt to
    this rank before the current window) and `forge_grain`, the exact position; restoring
    from it continues with the very next sample. Under DataLoader workers the rank's samples
    come from worker 0 alone (the others yield nothing), so none is repeated; its tokenizer
    runs on threads (`forge_grain.tokenize_pool`).
    """

    def __init__(self, dataset_name: str, split: str, text_field: str, seq_len: int, tokenizer_path: str,
                 rank: int = 0, world_size: int = 1, seed: int = 42, shuffle_buffer_size: int = 10000,
                 pack_sequences: bool = False, *, dataset_config: str | None = None, cache_dir=None):
        super().__init__()
        src = _hf_source(dataset_name, split, text_field, tokenizer_path, dataset_config, hf_streaming=True,
                         window=shuffle_buffer_size)
        config = DataConfig(sources=[src], seq_len=seq_len, global_batch_size=world_size, seed=seed, num_epochs=None)
        self.pipeline = Pipeline(config, rank, world_size, num_threads=0, prefetch=0, cache_dir=cache_dir,
                                 dtype=np.int64)
        self.pack_sequences, self.world_size = pack_sequences, world_size
        self._step, self._resume = 0, None

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.id > 0:
            return  # the rank's stream is one sequence, made in worker 0: other workers would repeat it
        it = self.pipeline.iterator(self._resume)
        self._resume = None
        self._step = it.step
        for batch in it:
            self._step = int(batch["step"]) + 1
            yield _sample({k: v[0] for k, v in batch.items() if k != "step"}, self.pack_sequences)

    def state_dict(self) -> dict:
        state = self.pipeline.state_at(self._step)
        (cursor,) = state["streams"][0].values()  # one canonical stream per rank (canonical_streams = world size)
        return {"epoch": cursor["epoch"], "rank_docs_consumed": cursor["row_index"] // self.world_size,
                "forge_grain": state}

    def load_state_dict(self, state: dict) -> None:
        if "forge_grain" not in state:
            raise ValueError("this state has no 'forge_grain' position (it was saved by KempnerForge itself); "
                             "an exact resume needs a state saved by this class")
        self.pipeline.check_state(state["forge_grain"])
        self._resume = state["forge_grain"]


class MixtureDataset(Dataset):
    """Map-style concatenation of datasets (KempnerForge's signature and attributes): each
    sample carries `dataset_idx`; `cumulative_sizes` is [0, len(ds0), len(ds0) + len(ds1), ...]
    and `dataset_names` the names, which KempnerForge's `MixtureSampler` and `train.py` read;
    `state_dict()` keys are `dataset_{i}`. Weighted sampling is the sampler's job, as in
    KempnerForge; for a closed-form, exactly resumable weighted mixture use a forge-grain
    `DataConfig`."""

    def __init__(self, datasets: list[Dataset], names: list[str] | None = None):
        if not datasets:
            raise ValueError("MixtureDataset needs at least one dataset")
        self.datasets = list(datasets)
        self._names = list(names) if names is not None else [f"dataset_{i}" for i in range(len(datasets))]
        if len(self._names) != len(self.datasets):
            raise ValueError(f"{len(self._names)} names for {len(self.datasets)} datasets")
        self._cumulative = [0, *np.cumsum([len(d) for d in self.datasets]).tolist()]

    @property
    def cumulative_sizes(self) -> list[int]:
        return list(self._cumulative)

    @property
    def dataset_names(self) -> list[str]:
        return list(self._names)

    def __len__(self) -> int:
        return self._cumulative[-1]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"Index {idx} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._cumulative, idx, side="right")) - 1
        return {**self.datasets[k][idx - self._cumulative[k]], "dataset_idx": k}

    def state_dict(self) -> dict:
        return {f"dataset_{i}": d.state_dict() for i, d in enumerate(self.datasets) if hasattr(d, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for i, d in enumerate(self.datasets):
            if f"dataset_{i}" in state and hasattr(d, "load_state_dict"):
                d.load_state_dict(state[f"dataset_{i}"])

    def close(self) -> None:
        """Release the datasets' memory maps."""
        for d in self.datasets:
            if hasattr(d, "close"):
                d.close()
