"""The documentation site (mkdocs.yml, docs/) builds strictly, a broken link fails it, and README.md stays short
with links that resolve.

The API reference pages are generated from the docstrings by mkdocstrings (griffe reads the source, nothing is
imported), so a docstring the reference cannot render, like a broken link or anchor, fails the strict build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

MKDOCS = Path(sys.executable).with_name("mkdocs")
BUILD_TIMEOUT_S = 120


def _build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "--site-dir", str(site)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def test_site_builds_strictly_with_the_api_reference(repo_root, tmp_path):
    site = tmp_path / "site"
    result = _build(repo_root / "mkdocs.yml", site, repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "quickstart/index.html", "benchmarks/index.html", "reference/evaluation/index.html"):
        assert (site / page).is_file(), page
    # Generated from beyond_agent/evaluation.py's docstrings, not written in docs/.
    assert "EvaluationConfig" in (site / "reference/evaluation/index.html").read_text(encoding="utf-8")


def test_a_broken_link_fails_the_strict_build(repo_root, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(repo_root / "docs", docs)
    with open(docs / "tests.md", "a", encoding="utf-8") as page:
        page.write("\n[x](missing-page.md)\n")
    config = yaml.safe_load((repo_root / "mkdocs.yml").read_text(encoding="utf-8"))
    config["docs_dir"] = str(docs)
    # mkdocstrings resolves `paths` against the config file's folder: point it back at the checkout.
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(repo_root)]
    copy = tmp_path / "mkdocs.yml"
    copy.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = _build(copy, tmp_path / "site", tmp_path)
    assert result.returncode != 0
    assert "missing-page.md" in result.stdout + result.stderr


def test_readme_is_short_keeps_the_two_commands_and_its_links_resolve(repo_root):
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 160
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert first_block, "README.md has no ```bash block"
    assert "bash scripts/quickstart.sh" in first_block.group(1)
    assert "bash scripts/test.sh" in first_block.group(1)
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]
    assert relative, "README.md links to no docs page"
    missing = [link for link in relative if not (repo_root / link.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
