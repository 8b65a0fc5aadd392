"""`prepare`: check a run's options, then hand it to a runner: the local one (processes on
this machine, `forge_grain.preparation.local`) or Apache Beam (`forge_grain.preparation.beam`);
an output at a URL is prepared locally and uploaded, one writer per URL. Both runners write
the same bytes; this module sits above both, so neither imports the other's dispatch."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from forge_grain.errors import PrepareError, StoreError
from forge_grain.paths import cache_root, is_url, private_cache
from forge_grain.preparation.local import Spec, prepare_local, special_ids
from forge_grain.corpora.files import refuse_missing_path
from forge_grain.stores.manifest import LAYOUTS
from forge_grain.tokenizer import load_tokenizer


def prepare(
    source: str | Path,
    output: str | Path,
    *,
    tokenizer: str | Path | None = None,
    text_field: str = "text",
    token_field: str | None = None,
    vocab_size: int | None = None,
    split: str | None = None,
    hf_config: str | None = None,
    text_unit: str = "document",
    data_files=None,
    list_separator: str | None = None,
    special_tokens_in_text: bool = False,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    layout: str = "bin",
    num_shards: int | None = None,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    piece_chars: int = 1 << 20,
    storage_options: dict | None = None,
    runner: str = "local",
    beam_options: list[str] | None = None,
    chat: str | None = None,
    train_roles: tuple[str, ...] = ("assistant",),
) -> Path | str:
    """Tokenize `source` (see `forge_grain.corpora.loading.load_corpus`) into a token store at `output`.

    Text (`text_field`): every non-empty document becomes `[BOS] + tokens + [EOS]`
    (`add_bos`/`add_eos`, on by default); special-token strings inside the text stay
    text unless `special_tokens_in_text=True`; lists of strings are joined only with a
    `list_separator`. Pre-tokenized ids (`token_field`): written as they are, checked
    against `vocab_size` (or the `tokenizer`'s); `bos_id`/`eos_id` declare the special
    ids the documents carry (checked), and `add_bos`/`add_eos` add them. Whitespace-only
    documents are skipped and counted. A text longer than `piece_chars` is tokenized in
    pieces with the same ids (see `TextTokenizer.encode_long`), so memory is bounded by
    the piece (about 150 bytes a token), not the largest document.
    Returns the store's path (`TokenStore.open` it).

    An `output` URL (`s3://bucket/store`, any fsspec URL; `storage_options` go to fsspec)
    is prepared in a local staging directory under `FORGE_GRAIN_CACHE`, then uploaded,
    manifest last (see `stores.uploads.upload_store`), and the staging copy is removed;
    re-running an interrupted command resumes both. Returns the URL.

    `chat="messages"`: each row's `messages` (or `text_field`, when given) is a conversation
    (a list of {"role", "content"}), rendered with the tokenizer's chat template as
    `transformers`' `apply_chat_template` renders it; the turns of `train_roles` (the
    assistant's) are the targets, the rest is context (the store carries a target mask:
    `forge_grain.corpora.chat`). `chat="prompt_completion"`: rows of `prompt` and
    `completion` (text, or lists of messages); the completion trains. BOS/EOS are added only
    when asked (`add_bos`/`add_eos`; templates write their own markers).

    `runner="beam"` runs it as an Apache Beam job with `beam_options` (Beam's command-line
    options, e.g. `["--runner=DataflowRunner", "--project=P", ...]`), writing the same
    bytes; inputs and `output` may then be any fsspec URL (see `forge_grain.preparation.beam`).
    """
    if is_url(output):
        _check_writable(output, storage_options)  # before any work: a missing bucket is found at once
    if is_url(output) and runner == "local":
        args = {k: v for k, v in locals().items() if k not in ("source", "output", "storage_options")}
        from forge_grain.stores.uploads import upload_store
        from forge_grain.stores.writer_lock import writer_lock

        staging = private_cache(cache_root() / "uploads") / hashlib.sha256(str(output).encode()).hexdigest()[:16]
        with writer_lock(str(output), storage_options):  # one writer per URL, whichever host runs it
            try:
                prepare(source, staging, **args)
            except PrepareError as e:  # the staging directory stands for the URL
                raise PrepareError(str(e).replace(str(staging), str(output))) from None
            upload_store(staging, str(output), storage_options, overwrite=overwrite, progress=progress)
        shutil.rmtree(staging, ignore_errors=True)  # the store is in object storage now; a re-run finds it complete
        return str(output)
    if layout not in LAYOUTS:
        raise PrepareError(f"unknown layout {layout!r} (choose one of {LAYOUTS})")
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise PrepareError(f"num_shards must be a positive integer, not {num_shards!r}")
    if not isinstance(piece_chars, int) or piece_chars < 1024:
        raise PrepareError(f"piece_chars must be an integer of at least 1024, not {piece_chars!r}")
    tokens = token_field is not None
    template = _chat_template(chat, tokens, layout, runner, tokenizer)
    if chat is not None:
        text_field = {"messages": "messages" if text_field == "text" else text_field, "prompt_completion": "prompt"}[chat]
        add_bos, add_eos = bool(add_bos), bool(add_eos)  # (the template writes the conversation's markers)
    if not is_url(source) and data_files is None and not any(c in str(source) for c in "*?[") \
            and not Path(str(source)).exists():
        refuse_missing_path(source)  # a mistyped input is named first, before what its options lack
    tok = None
    if tokenizer is not None or not tokens:  # a tokenizer's own errors name the tokenizer, not the input
        tok = load_tokenizer(tokenizer, bos=bos_token, eos=eos_token, special_tokens_in_text=special_tokens_in_text)
    try:
        vocab_size, bos, eos = special_ids(tok, tokens, vocab_size, bos_id, eos_id,
                                           named=(bos_token is not None, eos_token is not None))
    except PrepareError as e:  # the declarations do not fit together: say which input they were for
        raise PrepareError(str(e) if str(e).startswith(str(source)) else f"{source}: {e}") from None
    add_bos = (not tokens) if add_bos is None else add_bos
    add_eos = (not tokens) if add_eos is None else add_eos
    for flag, tid, what in ((add_bos, bos, "BOS"), (add_eos, eos, "EOS")):
        if flag and tid is None:
            how = (f"--{what.lower()}-id N" if tokens else
                   f"--{what.lower()}-token TOKEN, or {what.lower()}_token in a config's source")
            raise PrepareError(f"{tok.path if tok else source}: no {what} id known; name one ({how}) or leave it out "
                               f"(--no-{what.lower()})")
    out = output if is_url(output) else Path(output)  # a URL: only the Beam runner gets here
    if not is_url(out) and out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory; give a directory for the token store")
    spec = Spec(source, out, tok, vocab_size, bos, eos, add_bos, add_eos, text_field, token_field, split,
                 hf_config, text_unit, data_files, list_separator, special_tokens_in_text, layout, piece_chars, chat,
                 template, tuple(train_roles))
    if runner == "beam":
        try:
            from forge_grain.preparation.beam import prepare_beam
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("apache_beam"):
                raise
            raise PrepareError("--runner beam needs Apache Beam: pip install 'forge-grain[beam]'") from None

        return prepare_beam(spec, num_shards, overwrite, beam_options or [], progress, storage_options)
    if runner != "local":
        raise PrepareError(f"unknown runner {runner!r} (choose 'local' or 'beam')")
    return prepare_local(spec, num_shards, num_proc, overwrite, progress)


def _chat_template(chat, tokens: bool, layout: str, runner: str, tokenizer) -> tuple | None:
    """The chat template and its special tokens for `chat` (None without), or an error naming
    the option that cannot go with it."""
    if chat is None:
        return None
    if chat not in ("messages", "prompt_completion"):
        raise PrepareError(f"chat must be 'messages' or 'prompt_completion', not {chat!r}")
    for wrong, what in ((tokens, "a token field (ids are already tokens: give their masks to write_store)"),
                        (layout != "bin", f"layout {layout!r} (a store with target masks is 'bin')"),
                        (runner != "local", "the Beam runner (conversations are prepared by the local runner)")):
        if wrong:
            raise PrepareError(f"chat={chat!r} does not go with {what}")
    from forge_grain.corpora.chat import template_of
    from forge_grain.tokenizer import resolve

    local, _ = resolve(tokenizer)
    return template_of(local if local.is_dir() else local.parent)


def _check_writable(url, storage_options) -> None:
    from forge_grain.stores.uploads import check_writable

    try:
        check_writable(str(url), storage_options)
    except StoreError as e:
        raise PrepareError(f"{e}; nothing was tokenized") from None


