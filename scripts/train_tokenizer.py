"""Train the small byte-level BPE tokenizer shipped in forge_grain/assets.

It is trained on the Python standard library's own sources, which every machine
has, so the demo and the tests need no download. Re-run to regenerate:

    python scripts/train_tokenizer.py
"""

import pathlib
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|endoftext|>", "<|pad|>"]
VOCAB_SIZE = 8192
OUT = pathlib.Path(__file__).resolve().parents[1] / "forge_grain" / "assets" / "tokenizer.json"


def stdlib_texts(limit: int = 600):
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py"))[:limit]:
        yield path.read_text(encoding="utf-8", errors="replace")


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(stdlib_texts(), trainer=trainer)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT))
    print(f"wrote {OUT} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
