"""KempnerForge's dataset classes, with their signatures, samples, lengths and state keys, backed by forge-grain.

A KempnerForge training loop switches by its import line, even mid-run (its sampler state
picks up the same samples):

    from forge_grain.bridges.kempnerforge import MemoryMappedDataset, HuggingFaceDataset, StreamingHuggingFaceDataset, MixtureDataset

By default (`semantics="kempnerforge"`) each class means what KempnerForge's does:

- `MemoryMappedDataset(data_dir, seq_len)`: sample i is tokens [i*seq_len, (i+1)*seq_len) of
  one file, never crossing files, files in sorted order; `len` = sum of floor(file tokens /
  seq_len); `input_ids` = the sample's first seq_len - 1 tokens, `labels` the last.
- `HuggingFaceDataset`: documents in dataset order, each followed by EOS (empty ones
  skipped), concatenated and cut into chunks of seq_len + 1 (the tail dropped).
- `StreamingHuggingFaceDataset`: the stream shuffled by `datasets` with seed + epoch and
  `shuffle_buffer_size`, document k to rank k % world_size, chunks of seq_len + 1; one pass
  per `iter()`, then the epoch advances. Its state has KempnerForge's `epoch` and
  `rank_docs_consumed` (a state saved by KempnerForge resumes as KempnerForge resumes: those
  documents skipped, the packing buffer lost) and `next_doc` / `doc_offset`, where the next
  sample starts, so a state saved here resumes with the very next sample.
- `pack_sequences=True` (with `eos_token_id` for files): `doc_ids` counts the EOS tokens
  before each input token, and a label that follows an EOS is -100.
- Text is tokenized as KempnerForge's `AutoTokenizer` does: a special token's string written
  in a document ("<|endoftext|>", "<eos>") becomes its special id
  (`special_tokens_in_text=None` means True here, False with `semantics="forge_grain"`, whose
  sources keep text as text; pass a bool to decide).

What forge-grain adds without changing a sample: raw `.bin` files are read with a declared
`dtype=` (or `vocab_size=`) and width-checked, never guessed from the file size (KempnerForge
reads any file whose size is a multiple of 4 as uint32); tokenizers are local files or Hub
names read through the Hugging Face cache.

`semantics="forge_grain"` turns on forge-grain's packing instead: each token after the first
is a label exactly once (rows overlap by one token and cross files; no file's tail is
dropped), `segment_ids`/`position_ids` come with `pack_sequences`, the streaming class packs
`window` documents at a time and resumes exactly on any worker count of its pipeline.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from forge_grain.bridges.torch import IGNORE_INDEX
from forge_grain import DataConfig, Pipeline, SourceConfig, TokenStore, pack

SEMANTICS = ("kempnerforge", "forge_grain")


def _semantics(value: str) -> str:
    if value not in SEMANTICS:
        raise ValueError(f"semantics={value!r}: choose 'kempnerforge' (the default: KempnerForge's samples) or "
                         "'forge_grain' (forge-grain's packing)")
    return value


def kempnerforge_sample(tokens: np.ndarray, eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """KempnerForge's sample of a chunk: inputs all but its last token, labels all but its
    first; with `eos_id` (pack_sequences), `doc_ids` and -100 on labels across an EOS."""
    t = torch.from_numpy(np.asarray(tokens).astype(np.int64))
    out = {"input_ids": t[:-1], "labels": t[1:].clone()}
    if eos_id is not None:
        ends = t[:-1] == eos_id
        out["labels"][ends] = IGNORE_INDEX  # the token after an EOS opens another document
        out["doc_ids"] = torch.cumsum(ends, 0) - ends.long()  # EOS tokens strictly before each input
    return out


def _sample(row: dict, pack_sequences: bool) -> dict[str, torch.Tensor]:
    """One forge-grain packed row (1-D arrays) as a sample; with `pack_sequences`, labels that
    cross into another document are -100 and the document layout comes along."""
    out = {"input_ids": torch.from_numpy(row["inputs"].astype(np.int64)),
           "labels": torch.from_numpy(row["targets"].astype(np.int64))}
    if pack_sequences:
        out["labels"] = torch.where(torch.from_numpy(np.ascontiguousarray(row["loss_mask"])), out["labels"],
                                    IGNORE_INDEX)
        out["segment_ids"] = torch.from_numpy(row["segment_ids"].astype(np.int64))
        out["position_ids"] = torch.from_numpy(row["positions"].astype(np.int64))
        out["doc_ids"] = out["segment_ids"] - out["segment_ids"][0]
    return out


class _Samples(Dataset):
    """A token store read as samples, by either semantics (shared by the map-style classes).

    KempnerForge's: chunks of `chunk` tokens laid end to end inside each run of `runs` (token
    starts, end appended); forge-grain's: a concat plan of rows of `chunk - 1` inputs."""

    def __init__(self, store: TokenStore, chunk: int, runs, eos_id, semantics: str, seed: int):
        self.store, self.semantics, self._eos = store, _semantics(semantics), eos_id
        self._epoch = 0
        if semantics == "forge_grain":
            self._rows = pack(store, chunk - 1, "concat", seed=seed, shuffle=False, num_epochs=1)
            return
        self._chunk = chunk
        runs = np.asarray(runs, np.int64)
        self._run_starts = runs[:-1]
        self._first = np.concatenate([[0], np.cumsum(np.diff(runs) // chunk)]).astype(np.int64)

    def __len__(self) -> int:
        return self._rows.num_rows if self.semantics == "forge_grain" else int(self._first[-1])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"Index {idx} out of range [0, {len(self)})")
        idx = int(idx)
        if self.semantics == "forge_grain":
            return _sample(self._rows[idx], self._eos is not None)
        run = int(np.searchsorted(self._first, idx, side="right")) - 1
        start = int(self._run_starts[run]) + (idx - int(self._first[run])) * self._chunk
        return kempnerforge_sample(self.store.tokens(start, start + self._chunk), self._eos)

    def close(self) -> None:
        """Release the store's memory maps (KempnerForge's way to end a dataset; not read after)."""
        self.store.close()


class MemoryMappedDataset(_Samples):
    """Pre-tokenized `.npy`/`.bin` files in `data_dir` (KempnerForge's signature and samples).

    `dtype=` (or `vocab_size=`) declares raw `.bin` files; `.npy` files carry theirs.
    `pack_sequences=True` needs `eos_token_id`. No file matching is a `FileNotFoundError`.
    """

    def __init__(self, data_dir: str, seq_len: int, file_pattern: str = "*.npy", pack_sequences: bool = False,
                 eos_token_id: int | None = None, *, dtype: str | None = None, vocab_size: int | None = None,
                 semantics: str = "kempnerforge", seed: int = 0):
        if pack_sequences and eos_token_id is None:
            raise ValueError("pack_sequences=True needs eos_token_id: the id that ends each document")
        # KempnerForge's prepare_data.py cuts its shards inside documents: files need not hold whole ones
        store = TokenStore.open(data_dir, file_pattern=file_pattern, dtype=dtype, vocab_size=vocab_size,
                                **({"eos_id": eos_token_id, "whole_documents": False} if pack_sequences else {}))
        self.seq_len = seq_len
        super().__init__(store, seq_len, store.run_starts, eos_token_id if pack_sequences else None, semantics,
                         seed)

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


def _specials(special_tokens_in_text: bool | None, semantics: str) -> bool:
    """KempnerForge's tokenizer (`AutoTokenizer`) turns a special token's string written in a
    document ("<|endoftext|>") into its special id: its samples do, so the drop-ins do by
    default; forge-grain's semantics keep text as text. An explicit value decides."""
    return semantics == "kempnerforge" if special_tokens_in_text is None else bool(special_tokens_in_text)


class HuggingFaceDataset(_Samples):
    """A Hugging Face dataset, tokenized once into a cached forge-grain store (KempnerForge's
    signature and samples: chunks of seq_len + 1 of the documents joined, each with its EOS)."""

    def __init__(self, dataset_name: str, split: str, text_field: str, seq_len: int, tokenizer_path: str,
                 dataset_config: str | None = None, pack_sequences: bool = False, *, cache_dir=None,
                 semantics: str = "kempnerforge", seed: int = 0, special_tokens_in_text: bool | None = None):
        from forge_grain.preparation.hf_cache import eager_store

        src = _hf_source(dataset_name, split, text_field, tokenizer_path, dataset_config,
                         special_tokens_in_text=_specials(special_tokens_in_text, semantics))
        store = TokenStore.open(eager_store(src, cache_dir, progress=False))
        self.seq_len = seq_len
        # the store's documents end with the tokenizer's EOS (preparing refuses a tokenizer without one)
        eos = store.eos_id if pack_sequences else None
        super().__init__(store, seq_len + 1, [0, store.num_tokens], eos, semantics, seed)
        self._sample_idx = 0

    def state_dict(self) -> dict:
        """Keys: `epoch`, `sample_idx`, `total_sequences` (as KempnerForge)."""
        return {"epoch": self._epoch, "sample_idx": self._sample_idx, "total_sequences": len(self)}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state.get("epoch", 0)
        self._sample_idx = state.get("sample_idx", 0)


class StreamingHuggingFaceDataset(IterableDataset):
    """A streaming Hugging Face dataset for one rank (KempnerForge's signature and samples;
    see the module docstring). Under DataLoader workers `datasets` deals the stream's files
    (shards) to the workers, as in KempnerForge; a worker without a shard yields nothing.

    `semantics="forge_grain"`: forge-grain's streaming source instead (documents dealt to
    canonical streams, packed `window` at a time, every token a label once, epochs without
    end; under DataLoader workers, worker 0 makes the rank's stream); its state is under the
    `forge_grain` key and restores exactly.
    """

    def __init__(self, dataset_name: str, split: str, text_field: str, seq_len: int, tokenizer_path: str,
                 dataset_config: str | None = None, rank: int = 0, world_size: int = 1, seed: int = 42,
                 shuffle_buffer_size: int = 10000, pack_sequences: bool = False, *, semantics: str = "kempnerforge",
                 window: int = 1000, cache_dir=None, special_tokens_in_text: bool | None = None):
        super().__init__()
        self.semantics = _semantics(semantics)
        self.special_tokens_in_text = _specials(special_tokens_in_text, semantics)
        self.dataset_name, self.dataset_config, self.split, self.text_field = dataset_name, dataset_config, split, text_field
        self.seq_len, self.tokenizer_path, self.rank, self.world_size = seq_len, tokenizer_path, rank, world_size
        self.seed, self.shuffle_buffer_size, self.pack_sequences = seed, shuffle_buffer_size, pack_sequences
        self._epoch, self._rank_docs_consumed, self._at = 0, 0, (0, 0)
        self._resume: dict | None = None
        if semantics == "forge_grain":
            src = _hf_source(dataset_name, split, text_field, tokenizer_path, dataset_config, hf_streaming=True,
                             window=window, special_tokens_in_text=self.special_tokens_in_text)
            config = DataConfig(sources=[src], seq_len=seq_len, global_batch_size=world_size, seed=seed,
                                num_epochs=None)
            self.pipeline = Pipeline(config, rank, world_size, num_threads=0, prefetch=0, cache_dir=cache_dir,
                                     dtype=np.int64)
            self._step = 0

    def __iter__(self):
        if self.semantics == "kempnerforge":
            return self._one_pass()  # under DataLoader workers `datasets` deals the stream's shards to them
        info = get_worker_info()
        if info is not None and info.id > 0:
            return iter(())  # the rank's stream is one sequence, made in worker 0: other workers would repeat it
        return self._forge_grain()

    def _one_pass(self):
        """One pass over the shuffled stream, KempnerForge's chunks of this rank's documents."""
        from forge_grain.corpora.loading import load_texts
        from forge_grain.corpora.rows import document_text
        from forge_grain.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer_path, special_tokens_in_text=self.special_tokens_in_text)
        eos = 0 if tok.eos_id is None else tok.eos_id
        chunk = self.seq_len + 1
        resume, self._resume = self._resume or {}, None
        first_doc, offset = resume.get("next_doc", resume.get("rank_docs_consumed", 0)), resume.get("doc_offset", 0)
        stream = load_texts(self.dataset_name, text_field=self.text_field, split=self.split,
                            hf_config=self.dataset_config, streaming=True)
        stream = stream.shuffle(seed=self.seed + self._epoch, buffer_size=self.shuffle_buffer_size)
        buffer: list[int] = []
        docs: list[tuple[int, int]] = []  # (rank document, tokens) of each document in the buffer, in order
        self._at = (first_doc, offset)  # where the buffer's first token lies: (rank document, offset in it)
        self._rank_docs_consumed = first_doc  # a state saved before the first sample still skips what was read
        for k, example in enumerate(stream):
            doc = k // self.world_size
            if k % self.world_size != self.rank or doc < first_doc:
                continue
            text = example[self.text_field]
            if not isinstance(text, str):  # KempnerForge would fail inside its tokenizer: say what the row holds
                document_text(text, lambda: f"{self.dataset_name}: a row's field {self.text_field!r}")
            ids = tok.encode_batch([text])[0]
            if not ids:
                continue
            ids.append(eos)
            if doc == first_doc and offset:
                ids = ids[offset:]
            buffer.extend(ids)
            docs.append((doc, len(ids) + (offset if doc == first_doc else 0)))
            self._rank_docs_consumed = doc + 1
            while len(buffer) >= chunk:
                out, buffer = buffer[:chunk], buffer[chunk:]
                self._advance(docs, chunk)
                yield kempnerforge_sample(np.array(out, np.int64), eos if self.pack_sequences else None)
        self._epoch += 1
        self._rank_docs_consumed, self._at = 0, (0, 0)

    def _advance(self, docs: list, n: int) -> None:
        """Move the buffer's start `n` tokens on, through the documents it holds."""
        doc, offset = self._at
        if docs[0][0] != doc:  # the position named a document that turned out empty (skipped)
            doc, offset = docs[0][0], 0
        while n:
            length = docs[0][1]
            take = min(n, length - offset)
            n, offset = n - take, offset + take
            if offset == length:
                docs.pop(0)
                doc, offset = (docs[0][0], 0) if docs else (doc + 1, 0)
        self._at = (doc, offset)

    def _forge_grain(self):
        it = self.pipeline.iterator(self._resume)
        self._resume = None
        self._step = it.step
        for batch in it:
            self._step = int(batch["step"]) + 1
            yield _sample({k: v[0] for k, v in batch.items() if k != "step"}, self.pack_sequences)

    def state_dict(self) -> dict:
        if self.semantics == "forge_grain":
            state = self.pipeline.state_at(self._step)
            (cursor,) = state["streams"][0].values()  # one canonical stream per rank (canonical_streams = world size)
            return {"epoch": cursor["epoch"], "rank_docs_consumed": cursor["row_index"] // self.world_size,
                    "forge_grain": state}
        return {"epoch": self._epoch, "rank_docs_consumed": self._rank_docs_consumed,
                "next_doc": self._at[0], "doc_offset": self._at[1]}

    def load_state_dict(self, state: dict) -> None:
        if self.semantics == "forge_grain":
            if "forge_grain" not in state:
                raise ValueError("this state has no 'forge_grain' position (it was saved with KempnerForge's "
                                 "semantics); an exact resume with semantics='forge_grain' needs a state saved by it")
            self.pipeline.check_state(state["forge_grain"])
            self._resume = state["forge_grain"]
            return
        self._epoch = state.get("epoch", 0)
        self._resume = dict(state)


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
