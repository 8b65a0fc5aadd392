"""The `forge-grain` command line: prepare, inspect, demo."""

from __future__ import annotations

import argparse
import sys

from .errors import ForgeGrainError


def _prepare(a) -> None:
    from .preparation import prepare
    from .store import TokenStore
    from .summary import format_summary

    out = prepare(
        a.input, a.output, tokenizer=a.tokenizer, text_field=a.text_field, split=a.split, hf_config=a.hf_config,
        text_unit=a.text_unit, add_bos=a.bos, add_eos=a.eos, bos_token=a.bos_token, eos_token=a.eos_token,
        layout=a.layout, num_shards=a.num_shards, num_proc=a.num_proc, overwrite=a.overwrite,
        progress=not a.quiet,
    )
    print(format_summary(TokenStore.open(out)))


def _inspect(a) -> None:
    from .store import TokenStore
    from .summary import format_summary, plot_lengths

    store = TokenStore.open(
        a.path, verify=a.verify, dtype=a.dtype, eos_id=a.eos_id, bos_id=a.bos_id, vocab_size=a.vocab_size
    )
    print(format_summary(store))
    if a.verify:
        print("  verified    checksums and token ids OK")
    if a.plot:
        print(f"  plot        {plot_lengths(store, a.plot)}")
    if a.seq_len:
        from .summary import packing_report

        print(packing_report(store, a.seq_len, seed=a.seed))


def _demo(a) -> None:
    from .demo import run_demo

    summary = run_demo(a.workdir, max_files=a.max_files, num_proc=a.num_proc, steps=a.steps)
    if not all(summary["resume_matches"].values()):
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forge-grain", description="Token stores, packing and mixing on Grain.")
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("prepare", help="tokenize a text corpus into a token store")
    pr.add_argument("input", help="file, directory or glob of .txt/.jsonl/.parquet, a saved dataset, or a hub name")
    pr.add_argument("output", help="directory of the token store to write")
    pr.add_argument("--tokenizer", help="local tokenizer.json or tokenizer directory (default: the shipped one)")
    pr.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    pr.add_argument("--split", default="train", help="dataset split (default: train)")
    pr.add_argument("--hf-config", help="Hugging Face dataset configuration name")
    pr.add_argument("--text-unit", default="document", choices=["document", "line", "paragraph"],
                    help="for plain text files: one document per file, line or paragraph (default: document)")
    pr.add_argument("--no-bos", dest="bos", action="store_false", help="do not start documents with BOS")
    pr.add_argument("--no-eos", dest="eos", action="store_false", help="do not end documents with EOS")
    pr.add_argument("--bos-token", help="the BOS token's string (default: found by its usual names)")
    pr.add_argument("--eos-token", help="the EOS token's string (default: found by its usual names)")
    pr.add_argument("--layout", default="bin", choices=["bin", "arrayrecord"], help="on-disk layout (default: bin)")
    pr.add_argument("--num-shards", type=int, help="shards to write (default: about 64 MiB of text each)")
    pr.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (default: 1)")
    pr.add_argument("--overwrite", action="store_true", help="replace a store prepared with other settings")
    pr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=_prepare)

    ins = sub.add_parser("inspect", help="summarize a token store")
    ins.add_argument("path", help="token store directory, or foreign .npy/.bin file(s)")
    ins.add_argument("--verify", action="store_true", help="check checksums and token ids (reads everything)")
    ins.add_argument("--plot", metavar="PNG", help="also write a length histogram to this PNG")
    ins.add_argument("--dtype", help="dtype of foreign .bin files (default: uint16)")
    ins.add_argument("--eos-id", type=int, help="foreign files: documents end with this id")
    ins.add_argument("--bos-id", type=int, help="foreign files: documents start with this id")
    ins.add_argument("--vocab-size", type=int, help="foreign files: check ids are below this")
    ins.add_argument("--seq-len", type=int, help="also report how each packing strategy fills rows of this length")
    ins.add_argument("--seed", type=int, default=0, help="document shuffle seed for the packing report")
    ins.set_defaults(func=_inspect)

    de = sub.add_parser("demo", help="run the whole flow on a corpus that needs no download")
    de.add_argument("--workdir", default="forge-grain-demo", help="where to write (default: ./forge-grain-demo)")
    de.add_argument("--max-files", type=int, default=600, help="standard library files in the corpus")
    de.add_argument("--num-proc", type=int, default=2, help="tokenizer processes (default: 2)")
    de.add_argument("--steps", type=int, default=60, help="training steps to simulate (default: 60)")
    de.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ForgeGrainError as e:
        print(f"forge-grain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
