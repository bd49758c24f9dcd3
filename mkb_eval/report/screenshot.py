"""A screenshot of a report's HTML in headless Chromium: the check that the page renders, and the README image.

``python -m mkb_eval.report.screenshot report.html out.png [--width 1400] [--height 2400]``. The
browser is found on PATH (``chromium-headless-shell``, ``chromium``, ``chromium-browser``,
``google-chrome``) or named by ``MKB_CHROMIUM``; without one, :func:`find_browser` returns None
and callers say so (Debian: ``apt-get install chromium-headless-shell``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


class ScreenshotError(RuntimeError):
    """The browser is missing or did not write the image; one line says why."""


def find_browser() -> str | None:
    named = os.environ.get("MKB_CHROMIUM")
    if named:
        return named if shutil.which(named) or Path(named).is_file() else None
    return next((p for c in CANDIDATES if (p := shutil.which(c))), None)


def screenshot(html: Path, png: Path, *, width: int = 1400, height: int = 2400, timeout_s: float = 120.0) -> Path:
    """Render ``html`` (a local file) and write a PNG of the top ``width`` x ``height`` pixels."""
    browser = find_browser()
    if browser is None:
        raise ScreenshotError("no headless Chromium found (apt-get install chromium-headless-shell, or set MKB_CHROMIUM)")
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mkb-chromium-") as profile:
        argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png}",
                Path(html).resolve().as_uri()]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ScreenshotError(f"{browser} did not finish within {timeout_s:.0f} s") from None
    if not png.is_file() or png.stat().st_size == 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ScreenshotError(f"{browser} exited {res.returncode} without writing {png}: {tail[0][:200]}")
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=2400)
    args = ap.parse_args(argv)
    try:
        out = screenshot(Path(args.html), Path(args.png), width=args.width, height=args.height)
    except ScreenshotError as e:
        print(f"screenshot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
