"""Screenshots of every page of the documentation site, as a reader at 1280 px sees it.

    python scripts/docs_screenshots.py [OUT_DIR] [--height 2400]

Builds the site (`mkdocs build --strict`, the `docs` extra) into a temporary directory and
takes one PNG per page with headless Chromium (`chromium` on the PATH: Debian's package
`chromium`), 1280 px wide, the first `--height` px of each page. Look at them after a change
to the site's layout: what a test cannot see (a table of contents, a wrapped line, an
overflowing table) shows here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=Path("site-screenshots"))
    ap.add_argument("--height", type=int, default=2400, help="pixels of each page from its top")
    args = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("no chromium on the PATH (Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                       check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        pages = sorted(p for p in site.rglob("index.html") if "assets" not in p.parts and p.parent.name != "404")
        for page in pages:
            name = str(page.parent.relative_to(site)).replace("/", "-").strip(".") or "home"
            png = (args.out / f"{name}.png").resolve()
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size=1280,{args.height}", f"--screenshot={png}", page.as_uri()],
                           check=True, capture_output=True, timeout=120)
            print(png)


if __name__ == "__main__":
    main()
