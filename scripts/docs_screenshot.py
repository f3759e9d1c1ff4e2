"""Build the documentation site, serve it on 127.0.0.1, and screenshot pages in headless Chromium.

    python scripts/docs_screenshot.py                       # home, conversion and one API page into site-shots/
    python scripts/docs_screenshot.py --pages results/ --out /tmp/shots

Needs the docs extra (`pip install -e ".[docs]"`) and Debian's `chromium` (`apt install chromium`). The site is
built with `mkdocs build --strict` into a temporary folder and served by Python's own http.server on a free port;
each page is rendered by `chromium --headless --screenshot` at the given window size. Look at the PNGs: the figures
must render, and the code blocks and tables must be readable.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = ["", "conversion/", "api/functional/"]  # the home page, the conversion page, one API page


def build(site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)]
    subprocess.run(cmd, cwd=REPO, check=True, env=env)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request
        pass


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def screenshot(browser: str, url: str, png: Path, size: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size}"]  # fmt: skip
        subprocess.run([browser, *flags, f"--screenshot={png}", url], check=True, capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", nargs="+", default=PAGES, help="site paths to open ('' is the home page)")
    ap.add_argument("--out", default="site-shots", help="folder for the PNG screenshots")
    ap.add_argument("--size", default="1280,2400", help="browser window, width,height in pixels")
    ap.add_argument("--browser", default=shutil.which("chromium") or "chromium", help="the Chromium binary")
    args = ap.parse_args()
    if not shutil.which(args.browser):
        sys.exit(f"docs_screenshot: no browser at {args.browser!r}: install Debian's chromium (apt install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        server = serve(site)
        try:
            for page in args.pages:
                url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
                png = out / f"{page.strip('/').replace('/', '_') or 'home'}.png"
                screenshot(args.browser, url, png, args.size)
                print(f"{url} -> {png}")
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
