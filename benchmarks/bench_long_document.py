"""Peak memory of `forge-grain prepare` on one huge document, against a whole-document encode.

    python benchmarks/bench_long_document.py [--mb 200] [--peer-mb 10]

A corpus of a single `--mb` MB text document (the demo corpus's Python source, repeated)
is prepared in a fresh process and its peak RSS measured. The peer, measured in the same
run, is the plain whole-document `tokenizers` encode that prepare did before (and that
`datasets.map` does): it is run on a `--peer-mb` MB document, since at 200 MB it needs far
more memory than this machine has; its bytes per character of text are reported with the
extrapolation to `--mb`. Both processes are measured the same way (`ru_maxrss` of a
child that does only that work), and the tokens of prepare's store are checked equal to
a whole-document encode of the peer's document.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forge_grain.demo import stdlib_files
from report import parser, publish

CHILD_PREPARE = """
import json, resource, sys, time
from forge_grain import TokenStore, prepare
t = time.perf_counter()
out = prepare(sys.argv[1], sys.argv[2], num_shards=1, progress=False)
s = TokenStore.open(out)
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": s.num_tokens,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

CHILD_WHOLE = """
import json, resource, sys, time
from forge_grain.tokenizer import load_tokenizer
tok = load_tokenizer()
text = open(sys.argv[1], encoding="utf-8").read()
t = time.perf_counter()
ids = tok.backend.encode(text, add_special_tokens=False).ids
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": len(ids),
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

CHILD_EQUAL = """
import sys, numpy as np
from forge_grain import TokenStore
from forge_grain.tokenizer import load_tokenizer
text = open(sys.argv[1], encoding="utf-8").read()
whole = load_tokenizer().backend.encode(text, add_special_tokens=False).ids
doc = TokenStore.open(sys.argv[2])[0]
print(bool(np.array_equal(doc[1:-1], whole)))
"""


def one_document(source_files: list[Path], path: Path, mb: float) -> Path:
    """Concatenate source files until the text reaches `mb` MB: one document."""
    target = int(mb * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            for src in source_files:
                text = src.read_text(encoding="utf-8", errors="ignore")
                f.write(text)
                written += len(text.encode())
                if written >= target:
                    break
    return path


def run(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip().startswith("{") else out.stdout.strip()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=200)
    ap.add_argument("--peer-mb", type=float, default=10)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="forge-grain-long-"))
    files = list(stdlib_files(400))  # the demo corpus's Python sources
    for d in ("small", "big"):
        (work / d).mkdir(parents=True, exist_ok=True)
    small = one_document(files, work / "small" / "doc.txt", a.peer_mb)
    big = one_document(files, work / "big" / "doc.txt", a.mb)

    peer = run(CHILD_WHOLE, small)
    small_ours = run(CHILD_PREPARE, small.parent, work / "small-store")
    equal = run(CHILD_EQUAL, small, work / "small-store")
    t0 = time.perf_counter()
    ours = run(CHILD_PREPARE, big.parent, work / "big-store")
    small_chars, big_chars = len(small.read_text(encoding="utf-8")), len(big.read_text(encoding="utf-8"))
    peer_bytes_per_char = peer["peak_mb"] * 2**20 / small_chars
    lines = [
        f"one document of {a.mb:g} MB ({big_chars:,} characters): forge-grain prepare",
        f"  peak RSS {ours['peak_mb']:,.0f} MB, {ours['tokens']:,} tokens, {ours['seconds']:.1f} s "
        f"(process total {time.perf_counter() - t0:.1f} s)",
        f"peer, whole-document tokenizers encode of {a.peer_mb:g} MB ({small_chars:,} characters):",
        f"  peak RSS {peer['peak_mb']:,.0f} MB = {peer_bytes_per_char:,.0f} bytes per character; "
        f"at {a.mb:g} MB that is ~{peer_bytes_per_char * big_chars / 2**30:,.1f} GB",
        f"forge-grain on the same {a.peer_mb:g} MB: peak RSS {small_ours['peak_mb']:,.0f} MB "
        f"({peer['peak_mb'] / small_ours['peak_mb']:.1f}x less than the peer); tokens equal the whole encode: {equal}",
        f"ratio at {a.mb:g} MB: peer (extrapolated) / forge-grain = "
        f"{peer_bytes_per_char * big_chars / 2**20 / ours['peak_mb']:.1f}x",
    ]
    publish("long_document", lines)


if __name__ == "__main__":
    main()
