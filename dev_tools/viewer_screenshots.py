"""Screenshots of the run viewer for the docs: the dashboard and two episodes of one group side by side.

    python -m dev_tools.viewer_screenshots RUN_FOLDER --tokenizer outputs/tiny-qwen2 --out docs/images

Starts `python -m beyond_agent.viewer` on a free loopback port and drives Debian's Chromium with
Playwright (as tests/viewer do).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from envservice.childproc import ChildProcess, answers_200, free_port

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def shrink(path: Path) -> None:
    """A 128-colour palette: the docs' screenshots stay small (a page is mostly flat colour anyway)."""
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=128).save(path, optimize=True)


def shoot(url: str, out: Path, episode_route: str) -> list[Path]:
    """Take the two screenshots; returns their paths."""
    from playwright.sync_api import sync_playwright

    # (file, route, element scrolled to the top first)
    shots = [("viewer_dashboard.png", "#/dashboard", None), ("viewer_episode.png", episode_route, ".token-legend")]
    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        for name, route, top in shots:
            page.goto(f"{url}/{route}")
            page.wait_for_function("(route) => document.body.dataset.loaded === route", arg=route, timeout=60_000)
            page.wait_for_timeout(500)  # plotly's transitions
            path = out / name
            clip = None
            if top:  # a viewport-sized cut of the whole page, starting just above that element
                box = page.locator(top).first.bounding_box()
                clip = {"x": 0, "y": max(box["y"] - 60, 0), "width": 1400, "height": 900}
            page.screenshot(path=str(path), full_page=bool(clip), clip=clip)
            shrink(path)
            written.append(path)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    """Start the viewer, take the screenshots, stop the viewer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--episode", default="#/episode?step=1&kind=train&line=1&compare=2",
                        help="the route of the episode screenshot")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "beyond_agent.viewer", str(args.folder), "--port", str(port)]
    child = ChildProcess.start(command + (["--tokenizer", args.tokenizer] if args.tokenizer else []), "viewer")
    try:
        child.wait_until(lambda: answers_200(f"http://127.0.0.1:{port}/healthz"), 60, "answering /healthz")
        for path in shoot(f"http://127.0.0.1:{port}", args.out, args.episode):
            print(f"wrote {path}")
    finally:
        child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
