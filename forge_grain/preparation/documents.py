"""A shard's documents, read from the corpus's rows `BATCH_DOCS` at a time: text tokenized
(long texts in pieces), pre-tokenized ids checked, conversations rendered with their chat
template and their targets marked (`corpora.chat`). Each is (row, ids) or (row, ids, target
mask); empty documents are left out (and counted by the shard writer)."""

from __future__ import annotations

import numpy as np

from forge_grain.corpora.rows import NULL_TOKENS
from forge_grain.errors import PrepareError

BATCH_DOCS = 512  # documents tokenized per call: large enough for the Rust batch path


def documents(corpus, tok, job, start: int, stop: int):
    """Yield, per batch, the (row, token ids) of its non-empty documents and its row count."""
    read = _token_batch if job.tokens else _chat_batch if job.chat else _text_batch
    for lo in range(start, stop, BATCH_DOCS):
        hi = min(lo + BATCH_DOCS, stop)
        yield read(corpus, tok, job, lo, hi), hi - lo


def _chat_batch(corpus, tok, job, lo: int, hi: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Conversations: (row, ids, target mask) of each, rendered with the tokenizer's chat
    template (`corpora.chat`); an added BOS is no target, an added EOS is one."""
    from forge_grain.corpora.chat import ChatTemplate, conversation

    template = ChatTemplate(job.template, dict(job.specials), job.train_roles)
    rows = corpus.ds[lo:hi]
    docs = []
    for j in range(hi - lo):
        where = lambda r=lo + j: corpus.where(r)  # noqa: E731
        messages, trained_from = conversation(job.chat, {k: rows[k][j] for k in rows}, job.field, where)
        ids, mask = template.encode(tok, messages, where, trained_from)
        docs.append((lo + j, np.concatenate([job.bos, ids, job.eos]).astype(np.int64),
                     np.concatenate([np.zeros(len(job.bos), np.bool_), mask, np.ones(len(job.eos), np.bool_)])))
    return docs


def _text_batch(corpus, tok, job, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    from forge_grain.corpora.rows import document_text

    texts = [document_text(v, lambda r=lo + j: corpus.where(r), job.list_separator)
             for j, v in enumerate(_column(corpus, job.field, lo, hi))]
    keep = [(lo + j, t) for j, t in enumerate(texts) if t]
    short = [t for _, t in keep if len(t) <= job.piece_chars]
    encoded = iter(tok.encode_batch(short) if short else [])
    docs = []
    for row, text in keep:
        if len(text) <= job.piece_chars:
            docs.append((row, np.asarray([*job.bos, *next(encoded), *job.eos], np.int64)))
        else:
            docs.append((row, tok.encode_long(text, job.piece_chars, job.bos, job.eos)))
    return docs


def _column(corpus, field: str, lo: int, hi: int) -> list:
    """Rows [lo, hi) of a column as Python values; bytes that are not UTF-8 name their row."""
    try:
        return corpus.ds[lo:hi][field]
    except UnicodeDecodeError:
        column = corpus.ds.with_format("arrow")[lo:hi][field]
        for j in range(len(column)):
            try:
                column[j].as_py()
            except UnicodeDecodeError as e:
                raise PrepareError(
                    f"{corpus.where(lo + j)}: field {field!r} holds bytes that are not UTF-8 ({e.reason} at byte "
                    f"{e.start}); re-encode the input as UTF-8 or remove those bytes"
                ) from None
        raise


def _token_batch(corpus, tok, job, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
    """Pre-tokenized rows, read through Arrow (no Python list per id), checked as a whole."""
    import pyarrow.compute as pc

    column = corpus.ds.with_format("arrow")[lo:hi][job.field]
    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if column.null_count:
        j = next(j for j in range(len(column)) if not column[j].is_valid)
        raise PrepareError(f"{corpus.where(lo + j)}: {NULL_TOKENS}")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    ends = np.cumsum(lengths)
    if len(values) and (values.min() < 0 or values.max() >= job.vocab_size):
        bad = int(np.flatnonzero((values < 0) | (values >= job.vocab_size))[0])
        j = int(np.searchsorted(ends, bad, side="right"))
        raise PrepareError(
            f"{corpus.where(lo + j)}: token id {int(values[bad])} is outside the vocabulary [0, {job.vocab_size}) "
            "(wrong --vocab-size, or ids from another tokenizer?)"
        )
    docs = []
    for j, (a, b) in enumerate(zip(ends - lengths, ends)):
        if a == b:
            continue
        doc = values[a:b]
        for want, at, what in ((job.starts_with, 0, "start with BOS"), (job.ends_with, -1, "end with EOS")):
            if want is not None and doc[at] != want:
                flag = "--bos (add_bos=True)" if at == 0 else "--eos (add_eos=True)"
                raise PrepareError(
                    f"{corpus.where(lo + j)}: does not {what} id {want}, which was declared; pass {flag} to add "
                    "it, or leave the declaration out if the documents carry none"
                )
        docs.append((lo + j, np.concatenate([job.bos, doc, job.eos]).astype(np.int64) if job.bos or job.eos else doc))
    return docs
