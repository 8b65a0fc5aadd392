"""MkDocs hook: the site's home page is the README, its links made relative to `docs/`.

One text for both: the README links `docs/guides/x.md`, the site's home page (docs/index.md,
which holds only a pointer here) links `guides/x.md`; files outside `docs/` (the examples,
the benchmark results) are named, not linked, so that the site has no link it cannot follow.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text()
    return re.sub(r"\]\(docs/", "](", text.replace("](docs/)", "](index.md)"))
