"""Conversations as token ids and target masks: a tokenizer's chat template rendered as
`transformers`' `apply_chat_template` renders it, and the tokens of the turns that train
(the assistant's, by default) marked as targets.

The template is the Jinja one in the tokenizer's `tokenizer_config.json` (or its
`chat_template.jinja`), rendered in the sandbox `transformers` uses, with its settings
(`trim_blocks`, `lstrip_blocks`, loop controls), its globals (`raise_exception`,
`strftime_now`, `namespace`, `dict`), its `tojson` and the tokenizer's special tokens as
variables; the text is encoded as `apply_chat_template(tokenize=True)` encodes it (special
tokens of the template are their ids; no BOS/EOS added by the tokenizer).

Which characters train: a template with `{% generation %}` blocks says so itself (what
`return_assistant_tokens_mask=True` marks in `transformers`). Any other template is rendered
a turn at a time: a training turn is the text that rendering it adds after the
conversation before it with the generation prompt (its content and end-of-turn marker). A
template that does not render a conversation as a growing prefix (one that rewrites earlier
turns, as some drop earlier turns' reasoning) is refused, naming the row: the turns cannot
be told apart there. A token trains if any of its characters lie in a training turn.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from forge_grain.errors import PrepareError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARKING = contextvars.ContextVar("forge_grain_chat_marking", default=False)  # rendering to find generation blocks
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def template_of(directory: Path) -> tuple[str, dict]:
    """(the chat template, the special tokens' strings) of a tokenizer directory, or an error
    naming it when it has none."""
    config_file = Path(directory) / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise PrepareError(f"{config_file}: not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    jinja_file = Path(directory) / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        raise PrepareError(f"{directory}: the tokenizer has no chat template (chat_template in tokenizer_config.json, "
                           "or chat_template.jinja); give a tokenizer that has one to prepare conversations")
    specials = {}
    for key in SPECIAL_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    return template, specials


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled as `transformers` compiles it (the same sandbox and helpers)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records where the block's text falls."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            return f"\x00GEN{text}\x00END" if _MARKING.get() else text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` refusing underscore names, as `transformers`' (templates are untrusted code)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       namespace=Namespace, dict=dict)
    return env, env.from_string(template)


class ChatTemplate:
    """A chat template with the special tokens it reads, and the roles whose turns train."""

    def __init__(self, template: str, specials: dict, train_roles=("assistant",)):
        self.template, self.specials, self.train_roles = template, dict(specials), tuple(train_roles)
        self.tracked = bool(_GENERATION.search(template))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text `apply_chat_template(messages, tokenize=False)` gives."""
        _, compiled = _compiled(self.template)
        return compiled.render(messages=_messages(messages), tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.specials)

    def spans(self, messages: list[dict], where, trained_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans that train (turns from
        `trained_from` on: a completion after its prompt); `where()` names the row."""
        if self.tracked:
            text, spans = self._generation_spans(messages)
            cut = len(self.render(messages[:trained_from])) if trained_from else 0
            return text, [(a, b) for a, b in spans if a >= cut]
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if k < trained_from or message.get("role") not in self.train_roles:
                continue
            before = self.render(messages[:k], add_generation_prompt=message.get("role") == "assistant")
            upto = self.render(messages[: k + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise PrepareError(f"{where()}: the chat template does not render this conversation a turn at a time "
                                   f"(turn {k} changes the text before it), so its {message.get('role')} turns cannot "
                                   "be told apart; use a template with {% generation %} blocks, or another template")
            spans.append((len(before), len(upto)))
        return text, spans

    def _generation_spans(self, messages):
        _, compiled = _compiled(self.template)
        token = _MARKING.set(True)
        try:
            marked = compiled.render(messages=_messages(messages), tools=None, documents=None,
                                     add_generation_prompt=False, **self.specials)
        finally:
            _MARKING.reset(token)
        text, spans, at = [], [], 0
        for part in re.split(r"(\x00GEN|\x00END)", marked):
            if part == "\x00GEN":
                start = at
            elif part == "\x00END":
                spans.append((start, at))
            else:
                text.append(part)
                at += len(part)
        return "".join(text), spans

    def encode(self, tok, messages: list[dict], where, trained_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, target mask) of a conversation, encoded as `apply_chat_template(tokenize=True)`
        encodes it: the template's special tokens are their ids, no BOS/EOS added by the tokenizer."""
        text, spans = self.spans(messages, where, trained_from)
        backend = tok.backend
        saved = backend.encode_special_tokens
        backend.encode_special_tokens = False  # the template's markers are special tokens
        try:
            encoding = backend.encode(text, add_special_tokens=False)
        finally:
            backend.encode_special_tokens = saved
        ids = np.asarray(encoding.ids, np.int64)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), np.bool_)
        for a, b in spans:
            mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
        return ids, mask


def _messages(messages) -> list[dict]:
    """Messages as `transformers` hands them to a template: keys whose value is None dropped,
    reasoning under the names templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def conversation(mode: str, row: dict, field: str, where) -> tuple[list[dict], int]:
    """(the messages of a row, the first that may train). `mode` "messages": `row[field]` is
    the conversation. "prompt_completion": `row["prompt"]` and `row["completion"]`, both
    text (a user turn and the assistant's) or both lists of messages; only the completion's
    turns train."""
    if mode == "messages":
        return check_messages(row.get(field), where), 0
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], 1
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = check_messages(prompt, where)
        return prompt + check_messages(completion, where), len(prompt)
    raise PrepareError(f"{where()}: prompt and completion must both be text or both lists of messages, not "
                       f"{type(prompt).__name__} and {type(completion).__name__}")


def check_messages(value, where) -> list[dict]:
    """A row's conversation: a list of {"role": str, "content": ...} objects, or an error
    naming the row."""
    if not isinstance(value, list) or not value:
        raise PrepareError(f"{where()}: a conversation is a non-empty list of messages, not "
                           f"{type(value).__name__} {str(value)[:40]!r}")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PrepareError(f"{where()}: message {k} is not an object with a role ({str(m)[:60]!r})")
    return value
