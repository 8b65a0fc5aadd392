"""The command line's contract: every subcommand, given a bad argument, prints one line naming
the problem (and the file) and exits with status 2; never a Python traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import store, write_toml

from forge_grain import DataConfig, Pipeline
from forge_grain.cli import build_parser, main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A directory with a two-source config (`run.toml`), a store (`web`), a state of another
    config (`other.json`: another seed and batch size) and a file that is not JSON."""
    d = tmp_path_factory.mktemp("cli")
    stores = {"web": store(d / "web", 400, 1), "code": store(d / "code", 250, 2)}
    write_toml(d / "run.toml", stores)
    other = (d / "run.toml").read_text().replace("seed = 7", "seed = 8").replace("global_batch_size = 8",
                                                                                    "global_batch_size = 16")
    (d / "other.toml").write_text(other)
    (d / "wrongpath.toml").write_text((d / "run.toml").read_text().replace(str(stores["web"]), str(d / "nope-store")))
    (d / "huge.toml").write_text((d / "run.toml").read_text().replace("seq_len = 64", "seq_len = 16000"))
    state = Pipeline(DataConfig.from_toml(d / "other.toml"), 0, 1, num_threads=0).state_at(3)
    (d / "other.json").write_text(json.dumps(state))
    (d / "bad.json").write_text("{not json")
    (d / "notes.txt").write_text("plain text\n")
    (d / "docs").mkdir()
    (d / "docs" / "a.md").write_text("# a document\n")
    (d / "docs" / "notes.rst").write_text("a document prepare does not read\n")
    from tokenizers import Tokenizer, models

    eos_only = Tokenizer(models.WordLevel(vocab={"x": 0, "</s>": 1}, unk_token="x"))
    eos_only.add_special_tokens(["</s>"])
    eos_only.save(str(d / "eos-only.json"))
    return d


BAD = [  # (arguments, what the one line must say)
    ("", r"the following arguments are required: command"),
    ("frobnicate", r"invalid choice: 'frobnicate'"),
    ("explain run.toml --step 99999", r"step 99999 is outside this run's steps \[0, 133\]"),
    ("explain run.toml --step -1", r"argument --step: -1 is not >= 0"),
    ("explain run.toml --step 1.5", r"argument --step: '1.5' is not an integer"),
    ("explain run.toml --step 1 --state missing.json", r"--state: missing.json: cannot read \(No such file"),
    ("explain run.toml --step 1 --state bad.json", r"--state: bad.json: not a saved state \(invalid JSON"),
    ("explain run.toml --step 1 --state other.json", r"--state other.json: a resume may not change \['seed'\]"),
    ("explain run.toml --step 1 --world-size 2 --rank 5", r"shard index 5 must be in \[0, 2\)"),
    ("explain run.toml --step 1 --world-size 0", r"argument --world-size: 0 is not positive"),
    ("explain nope.toml --step 1", r"nope.toml: No such file or directory"),
    ("explain notes.txt --step 1", r"notes.txt: not valid TOML"),
    ("plan nope.toml", r"nope.toml: No such file or directory"),
    ("plan run.toml --steps -5", r"argument --steps: -5 is not positive"),
    ("plan run.toml --plot nodir/x.png", r"--plot: nodir/x.png: the directory nodir does not exist"),
    ("plan run.toml --plot web", r"--plot: web is a directory"),
    ("plan run.toml --world-size 0", r"--world-size: 0 is not positive"),
    ("plan run.toml --step 10", r"unrecognized arguments: --step 10"),
    ("plan wrongpath.toml", r"error: wrongpath.toml: source 'web': \S*nope-store: does not exist"),
    ("plan huge.toml", r"global_batch_size 8 is larger than the \d rows of num_epochs=2 at seq_len 16,000: source "
                       r"'web' packs \d row\(s\) of its [\d,]+ tokens; source 'code' packs \d row\(s\).*Lower seq_len or "
                       r"global_batch_size, or raise num_epochs"),  # no abbreviation of --steps
    ("explain run.toml --step 1 --deco", r"unrecognized arguments: --deco"),
    ("replay run.toml --steps 0:99999 --out x.npz", r"step 134 is outside this run's steps"),
    ("replay run.toml --steps 5:2 --out x.npz", r"steps A:B need 0 <= A < B"),
    ("replay run.toml --steps 0:2 --out nodir/x.npz", r"--out: nodir/x.npz: the directory nodir does not exist"),
    ("replay run.toml --steps 0:2 --out web", r"--out: web is a directory"),
    ("replay run.toml --steps 0:2", r"the following arguments are required: --out"),
    ("hashes run.toml --steps 133:135", r"step 134 is outside this run's steps"),
    ("hashes run.toml --steps x", r"steps must be A:B"),
    ("inspect nope", r"nope: does not exist"),
    ("inspect web --seq-len 0", r"--seq-len: 0 is not positive"),
    ("inspect web --plot nodir/x.png", r"--plot: nodir/x.png: the directory nodir does not exist"),
    ("inspect web --dtype float77", r"web: dtype 'float77' is not a numpy dtype"),
    ("inspect web --format parquet", r"invalid choice: 'parquet'"),
    ("inspect notes.txt", r"notes.txt: a raw token file does not record its dtype"),
    ("prepare nope out --tokenizer nope.json", r"nope.json: tokenizer not found"),
    ("prepare notes.txt out --num-shards 0", r"--num-shards: 0 is not positive"),
    ("prepare notes.txt web", r"web: already holds a token store prepared with other settings"),
    ("prepare missing.jsonl out --token-field ids", r"error: missing\.jsonl: no such file or directory"),
    ("prepare notes.txt out --tokenizer tok/bpe12.json", r"error: tok/bpe12\.json: tokenizer not found"),
    ("prepare notes.txt out --tokenizer eos-only.json", r"no BOS id known; name one \(--bos-token TOKEN, or bos_token "
                                                         r"in a config's source\) or leave it out \(--no-bos\)"),
    ("prepare docs out", r"docs: holds 1 file\(s\) of a kind prepare does not read \(docs/notes\.rst\)"),
    ("demo --steps -1", r"--steps: -1 is not positive"),
    ("demo --max-files 0", r"--max-files: 0 is not positive"),
    ("config-reference extra", r"unrecognized arguments: extra"),
    # what an input controls is bounded, and nothing but a regular file is read or replaced
    ("plan run.toml --state /dev/zero", r"--state: /dev/zero: not a regular file"),
    ("explain run.toml --step 1 --state /dev/zero", r"--state: /dev/zero: not a regular file"),
    ("plan /dev/zero", r"/dev/zero: not a regular file; a config file is a file"),
    ("replay run.toml --steps 0:2 --out /dev/full", r"--out: /dev/full exists and is not a regular file"),
    ("plan run.toml --plot /dev/full", r"--plot: /dev/full exists and is not a regular file"),
    ("inspect web --plot /dev/full", r"--plot: /dev/full exists and is not a regular file"),
    ("inspect web --seq-len 1000000000000", r"--seq-len: 1,000,000,000,000 tokens a row is past 16,777,216"),
    ("prepare notes.txt s3://b/x --storage-options [1,2]", r"--storage-options: a JSON object of options is needed"),
    ("prepare notes.txt out2 --runner beam --beam-option garbage",
     r"Beam options \['--garbage'\]: not options Beam knows"),
]


@pytest.mark.parametrize("args, says", BAD, ids=[a or "(none)" for a, _ in BAD])
def test_a_bad_argument_is_one_line_and_status_2(run, monkeypatch, capsys, args, says):
    monkeypatch.chdir(run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        code = main(args.split())
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("forge-grain"), err
    assert "Traceback" not in err
    assert re.search(says, lines[0]), lines[0]


def test_the_table_covers_every_subcommand():
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    covered = {args.split()[0] for args, _ in BAD if args}
    assert set(commands) <= covered, set(commands) - covered


def test_a_real_process_prints_no_traceback(run):
    """The installed entry point too (not only `main` in this process)."""
    r = subprocess.run([sys.executable, "-m", "forge_grain", "explain", "run.toml", "--step", "1", "--state",
                        "bad.json"], cwd=run, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


HEAVY = ("jax", "grain", "torch", "transformers", "numba", "tokenizers", "datasets")


@pytest.mark.parametrize("args", ["--version", "--help", "plan MISSING.toml", "plan misspelt.toml",
                                  "explain misspelt.toml --step 1", "inspect misspelt.toml", "plan run.toml --step 3"])
def test_a_config_mistake_answers_before_the_heavy_modules_load(run, args):
    """A wrong path, a misspelt key, --help and --version are answered from the config alone:
    jax, grain, torch, transformers and numba load when a pipeline is built (they took 1-30 s)."""
    (run / "misspelt.toml").write_text((run / "run.toml").read_text().replace("seq_len", "seq_lenn", 1))
    probe = ("import sys\nfrom forge_grain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe, *args.split()], cwd=run, capture_output=True, text=True)
    *said, loaded = r.stderr.strip().splitlines() or [""]
    assert loaded == "[]", r.stderr
    if "toml" in args:
        assert len(said) == 1 and "error:" in said[0], r.stderr  # the one-line answer, before any import
