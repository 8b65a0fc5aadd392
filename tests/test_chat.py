"""Conversations prepared with their tokenizer's chat template: the text and ids are what
`transformers`' `apply_chat_template` gives for the same messages, for templates of several
real styles (ChatML as Qwen 2.5 writes it, Llama 3's headers, Mistral's [INST], and a ChatML
with `{% generation %}` blocks, whose assistant mask `transformers` computes too); the
assistant's turns are the targets, and the store trains those alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from forge_grain import PrepareError, TokenStore, prepare
from forge_grain.corpora.chat import ChatTemplate, template_of
from forge_grain.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

# Qwen 2.5's template (tools left out), Llama 3.1's (dates and tools left out), Mistral's
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MISTRAL = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")
CHATML_GENERATION = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "chatml_generation": CHATML_GENERATION}
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<s>", "</s>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "Seven, or 7 — both <|im_end|> fine."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Eleven.\n\nAnd 13."}],
    [{"role": "user", "content": "Say nothing"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "ok  "}, {"role": "assistant", "content": "  spaced  "}],
]


def tokenizer_dir(base, style: str):
    """The shipped tokenizer with the templates' special tokens, and a tokenizer_config.json
    naming the template and the tokens it reads."""
    from tokenizers import Tokenizer

    d = base / style
    d.mkdir()
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    bos, eos = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "mistral": ("<s>", "</s>")}.get(
        style, ("<|bos|>", "<|im_end|>"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATES[style], "bos_token": bos, "eos_token": eos, "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat_tokenizers")
    return {style: tokenizer_dir(base, style) for style in TEMPLATES}


def conversations_for(style):
    if style == "mistral":  # user and assistant only, alternating
        return [[m for m in c if m["role"] != "system"] for c in CONVERSATIONS]
    return CONVERSATIONS


@pytest.mark.parametrize("style", list(TEMPLATES))
def test_a_chat_renders_and_encodes_as_transformers_does(tokenizers, style):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tokenizers[style]))
    template, specials = template_of(tokenizers[style])
    chat = ChatTemplate(template, specials)
    tok = load_tokenizer(str(tokenizers[style]))
    for messages in conversations_for(style):
        for prompt in (False, True):
            assert chat.render(messages, prompt) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)
        ids, mask = chat.encode(tok, messages, lambda: "row")
        want = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=style == "chatml_generation")
        assert ids.tolist() == list(want["input_ids"])
        if style == "chatml_generation":  # transformers' own assistant mask, token for token
            assert mask.astype(int).tolist() == list(want["assistant_masks"])


@pytest.mark.parametrize("style", ["chatml", "llama3", "mistral"])
def test_the_assistants_turns_are_the_targets(tokenizers, style):
    """What trains is each assistant turn's content and its end-of-turn marker, decoded back:
    the prompt and the user's turns never."""
    template, specials = template_of(tokenizers[style])
    chat = ChatTemplate(template, specials)
    tok = load_tokenizer(str(tokenizers[style]))
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}[style]
    for messages in conversations_for(style):
        ids, mask = chat.encode(tok, messages, lambda: "row")
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        trained = [tok.backend.decode(ids[r].tolist(), skip_special_tokens=False) for r in runs if mask[r[0]]]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(trained) == len(answers)
        for text, answer in zip(trained, answers):
            assert end in text and answer.strip().split(" ")[0] in text
            assert "user" not in text and "INST" not in text


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizers, tmp_path):
    d = shutil.copytree(tokenizers["chatml"], tmp_path / "rewrites")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- for message in messages %}{%- if loop.last %}{{- '<|im_start|>' + message.role + "
                               "'\\n' + message.content + '<|im_end|>' }}{%- else %}{{- message.role }}{%- endif %}"
                               "{%- endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    template, specials = template_of(d)
    with pytest.raises(PrepareError, match=r"row 3: the chat template does not render this conversation a turn"):
        ChatTemplate(template, specials).spans(CONVERSATIONS[1], lambda: "row 3")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("style", ["chatml", "chatml_generation"])
def test_prepare_writes_conversations_with_their_masks(tokenizers, tmp_path, style):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tokenizers[style]))
    rows = [{"messages": c, "id": k} for k, c in enumerate(CONVERSATIONS * 4)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    store = TokenStore.open(prepare(data, tmp_path / "store", tokenizer=str(tokenizers[style]), chat="messages",
                                    num_shards=2, progress=False), verify=True)
    assert store.masked and len(store) == len(rows)
    chat = ChatTemplate(*template_of(tokenizers[style]))
    tok = load_tokenizer(str(tokenizers[style]))
    for i, row in enumerate(rows):
        want = theirs.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=style == "chatml_generation")
        assert store[i].tolist() == list(want["input_ids"])  # no BOS/EOS added: the template's markers
        assert np.array_equal(store.target_mask(i), chat.encode(tok, row["messages"], lambda: "")[1])
        if style == "chatml_generation":
            assert store.target_mask(i).astype(int).tolist() == list(want["assistant_masks"])


def test_prompt_completion_rows_train_the_completion(tokenizers, tmp_path):
    rows = [{"prompt": "Capital of France?", "completion": "Paris."},
            {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Bye"}],
             "completion": [{"role": "assistant", "content": "Goodbye."}]}]
    data = write_jsonl(tmp_path / "pc.jsonl", rows[:1] * 3)
    data2 = write_jsonl(tmp_path / "pc2.jsonl", rows[1:] * 3)
    tok = load_tokenizer(str(tokenizers["chatml"]))
    for path, answer, not_trained in ((data, "Paris.", "France"), (data2, "Goodbye.", "Hello")):
        store = TokenStore.open(prepare(path, tmp_path / path.stem, tokenizer=str(tokenizers["chatml"]),
                                        chat="prompt_completion", progress=False))
        trained = tok.backend.decode(store[0][store.target_mask(0)].tolist(), skip_special_tokens=False)
        assert answer in trained and not_trained not in trained and trained.endswith("<|im_end|>\n")


def test_prepare_chat_errors_name_the_row_or_the_option(tokenizers, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": "just text"}])
    with pytest.raises(PrepareError, match=r"bad.jsonl, row 1: a conversation is a non-empty list of messages"):
        prepare(bad, tmp_path / "o1", tokenizer=str(tokenizers["chatml"]), chat="messages", progress=False)
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(PrepareError, match="has no chat template"):
        prepare(good, tmp_path / "o2", chat="messages", progress=False)  # the shipped tokenizer has none
    with pytest.raises(PrepareError, match="does not go with layout 'arrayrecord'"):
        prepare(good, tmp_path / "o3", tokenizer=str(tokenizers["chatml"]), chat="messages", layout="arrayrecord")


def test_the_cli_prepares_conversations(tokenizers, tmp_path):
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    r = subprocess.run([sys.executable, "-m", "forge_grain", "prepare", str(data), str(tmp_path / "s"), "--tokenizer",
                        str(tokenizers["llama3"]), "--chat", "messages", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    store = TokenStore.open(tmp_path / "s")
    assert store.masked and 0 < store.target_mask(1).sum() < len(store[1])


def test_a_config_mixes_a_chat_source_into_pre_training_data(tokenizers, tmp_path):
    """A mid-training phase brings a Hugging Face chat source in: tokenized once with its
    template into a cached masked store, trained on its assistant turns only."""
    from forge_grain import ConfigError, DataConfig, Pipeline

    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 20])
    web = prepare(write_jsonl(tmp_path / "web.jsonl", [{"text": f"document {i} " * 30} for i in range(40)]),
                  tmp_path / "web", tokenizer=str(tokenizers["chatml"]), progress=False)
    chat = dict(name="chat", hf_dataset="json", hf_data_files=str(data), tokenizer=str(tokenizers["chatml"]),
                chat="messages")
    config = DataConfig.from_dict(dict(
        sources=[dict(name="web", path=str(web), weight=1.0), {**chat, "weight": 0.0}],
        phases=[dict(start_step=4, weights={"web": 0.5, "chat": 0.5})],
        seq_len=64, global_batch_size=4, seed=3, num_epochs=None, max_steps=12))
    p = Pipeline(config, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    tok = load_tokenizer(str(tokenizers["chatml"]))
    chat_rows = 0
    for s in range(12):
        b = p.batch(s)
        for row in np.flatnonzero(b["source_id"] == 1):
            assert s >= 4
            chat_rows += 1
            trained = tok.backend.decode(b["targets"][row][b["loss_mask"][row]].tolist(), skip_special_tokens=False)
            assert "user" not in trained and "system" not in trained and "<|im_end|>" in trained
    assert chat_rows > 0 and p.stores[1].masked
    for bad, message in ((dict(hf_streaming=True), "not streamed; set hf_streaming = false"),
                         (dict(chat="dialogue"), "chat: \"messages\" or \"prompt_completion\"")):
        with pytest.raises(ConfigError, match=message):
            DataConfig.from_dict(dict(sources=[{**chat, **bad}], seq_len=64, global_batch_size=4))
