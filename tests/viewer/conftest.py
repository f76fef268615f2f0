"""Fixtures of the viewer tests: a recorded run folder, the real viewer process, and Debian's Chromium.

`recorded_run/` is a trimmed copy of an experiment folder that a real CPU run wrote: `python launcher.py
--conf examples/quickstart/cpu_tiny.yaml --with-envservice --with-viewer -- trainer.total_training_steps=3
trainer.test_freq=2 beyond_agent.rounds.rounds=4 data.max_response_length=256` (tiny model, BabyAI;
checkpoints, data and logs left out). Each test gets its own copy, so it may append to it as a running
training would.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from envservice.childproc import ChildProcess, answers_200, free_port

RECORDED_RUN = Path(__file__).parent / "recorded_run"
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps trying to reach Google on this closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """A fresh copy of the recorded run."""
    return Path(shutil.copytree(RECORDED_RUN, tmp_path / RECORDED_RUN.name))


@pytest.fixture
def viewer_url(run_folder: Path, tiny_model_dir: Path, tmp_path: Path):
    """`python -m beyond_agent.viewer` over the run's copy, on a free loopback port; its URL."""
    port = free_port()
    child = ChildProcess.start([sys.executable, "-m", "beyond_agent.viewer", str(run_folder), "--port",
                                str(port), "--tokenizer", str(tiny_model_dir)], "viewer", tmp_path / "viewer.log")
    url = f"http://127.0.0.1:{port}"
    try:
        child.wait_until(lambda: answers_200(f"{url}/healthz"), timeout_s=60, what="answering /healthz")
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="session")
def chromium():
    """Debian's Chromium driven by Playwright (scripts/install.sh installs the `chromium` package)."""
    assert CHROMIUM.exists(), (f"{CHROMIUM} is missing: run `bash scripts/install.sh`, which installs Debian's "
                               "chromium package with apt-get (the viewer's browser tests need it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(chromium):
    """A new browser page; console errors of the page fail the test that used it."""
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"the page raised: {errors}"
