"""The code blocks of the README and the documentation pages, and how each is run.

A fenced block runs by its language: `python` in the page's own interpreter session (blocks
share names in page order, as a reader's session would), `bash` line by line where a line
is a cheap `forge-grain` command (`prepare`, `plan`, `inspect`, `explain`, `hashes`,
`config-reference`, `--version`; other lines, such as `pip install`, are shown, not run),
and `toml` parsed and checked as a config (`DataConfig`). An HTML comment just before a
fence (invisible on the page) says more:

- `<!-- file: NAME -->`: the block is written to NAME in the page's directory (a config the
  next blocks read);
- `<!-- before: CODE -->`: CODE runs first, unseen (what a fragment assumes: a batch, a
  model, a mesh);
- `<!-- not run: REASON -->`: the block is not run, for the reason given (another project's
  code, a GPU, a cluster); tests/test_docs.py lists them;
- `<!-- output of: COMMAND -->` (before a `text` block): COMMAND runs there, and what it prints
  must match the block line by line (`...` in a line stands for any text; a line of `...`
  alone for any lines), so an example output cannot go stale.

Other blocks (`text`, unlabelled: file listings, outputs) are not code.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ("prepare", "plan", "inspect", "explain", "hashes", "config-reference", "--version")
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOTE = re.compile(r"<!--\s*(file|before|not run|output of):\s*(.*?)\s*-->", re.S)


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    file: str | None = None
    before: str | None = None
    not_run: str | None = None
    output_of: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, with the notes just before each."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        block = Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n")
        k = i - 1  # notes: the comments right above the fence
        while k >= 0 and lines[k].strip().endswith("-->"):
            start = k
            while start >= 0 and "<!--" not in lines[start]:
                start -= 1
            for kind, text in _NOTE.findall("\n".join(lines[start:k + 1])):
                setattr(block, {"file": "file", "before": "before", "not run": "not_run",
                                "output of": "output_of"}[kind], text)
            k = start - 1
        out.append(block)
        i = j + 1
    return out


def cheap_commands(code: str) -> list[str]:
    """The lines of a bash block that are cheap forge-grain commands (continuations joined)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "forge-grain" and parts[1] in CHEAP:
            out.append(line)
    return out


# an `output of:` note ending so: the output shown is real, but its numbers come from the corpus
# the docs' workspace builds from this Python's standard library, so any number matches a number
NUMBERS_VARY = " (numbers from this Python's standard library)"
_NUMBER = re.compile(r"\d[\d,.]*")


def matches(shown: str, printed: str, any_numbers: bool = False) -> bool:
    """Whether `printed` is what `shown` shows: line by line, `...` within a line any text, a
    line of `...` any lines (blank lines are not compared); with `any_numbers`, a number
    where a number is shown."""
    want = [line.rstrip() for line in shown.splitlines() if line.strip()]
    got = [line.rstrip() for line in printed.splitlines() if line.strip()]
    if any_numbers:
        want, got = ([_NUMBER.sub("0", line) for line in lines] for lines in (want, got))

    def line(w: str, g: str) -> bool:
        return re.fullmatch(".*".join(map(re.escape, w.split("..."))), g) is not None

    def walk(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i].strip() == "...":
            return any(walk(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and line(want[i], got[j]) and walk(i + 1, j + 1)
    return walk(0, 0)
