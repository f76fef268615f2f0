"""The import layering (pyproject.toml's [tool.importlinter] contracts) holds, and breaking it fails.

`lint-imports` is import-linter's command; it reads the contracts from pyproject.toml. The violation tests
copy our packages into a temporary folder, add one import that breaks one contract, and run the same
command there: each must fail and name the contract it broke.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("beyond_agent", "recipe", "envservice", "launch", "dev_tools", "verl_cpu", "sandbox")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run import-linter over the packages under `root` (found there first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_every_contract():
    result = lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
    assert result.stdout.count("KEPT") == 4


@pytest.fixture(scope="module")
def copy_of_packages(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


VIOLATIONS = {
    "envservice imports the library": (
        "envservice/registry.py", "import beyond_agent.tasks\n",
        "programs above the library, the library above envservice"),
    "the library imports the viewer": (
        "beyond_agent/tasks.py", "import beyond_agent.viewer.app\n", "the library's own floors"),
    "the library imports a recipe": (
        "beyond_agent/trajectories.py", "import recipe.multiturn_rl.trainer\n",
        "programs above the library, the library above envservice"),
    "the sandbox imports envservice": (
        "sandbox/config.py", "import envservice.protocol\n",
        "programs above the library, the library above envservice, the sandbox below all"),
    "an import circle inside envservice": (
        "envservice/backends.py", "import envservice.workers\n", "no import circles"),
}


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_a_deliberate_violation_breaks_its_contract(copy_of_packages, name):
    module, line, contract = VIOLATIONS[name]
    path = copy_of_packages / module
    original = path.read_text()
    path.write_text(original + "\n" + line)
    try:
        result = lint_imports(copy_of_packages)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout


# ----- only command-line modules parse arguments ---------------------------------------------------------

CODE_FOLDERS = ("beyond_agent", "recipe", "envservice", "launch", "dev_tools", "verl_cpu")


def is_cli_module(path: Path, source: str) -> bool:
    """A module a user runs: `__main__.py`, `cli.py`, or one with an `if __name__ == "__main__":` block."""
    return path.name in ("__main__.py", "cli.py") or 'if __name__ == "__main__":' in source


def namespace_parameters(source: str) -> list[str]:
    """Functions with a parameter annotated `argparse.Namespace`, or an unannotated one named `args`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for argument in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(argument.annotation) if argument.annotation else ""
                if "Namespace" in annotation or (argument.arg == "args" and not annotation):
                    found.append(f"{node.name}({argument.arg}) at line {node.lineno}")
    return found


def test_no_function_outside_a_cli_module_takes_an_argparse_namespace():
    offenders = {}
    for folder in CODE_FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            source = path.read_text()
            if not is_cli_module(path, source) and namespace_parameters(source):
                offenders[str(path.relative_to(REPO_ROOT))] = namespace_parameters(source)
    assert offenders == {}


def test_the_namespace_check_finds_one():
    source = "import argparse\ndef f(x, options: argparse.Namespace):\n    pass\ndef g(args):\n    pass\n"
    assert namespace_parameters(source) == ["f(options) at line 2", "g(args) at line 4"]
    assert not is_cli_module(Path("lib.py"), source)


def test_every_program_scores_models_with_the_one_evaluate():
    """collect, Agent-R and the learning bench call `beyond_agent.evaluation.evaluate`; AgentEvol calls collect."""
    callers = ("beyond_agent/collect.py", "recipe/agent_r/main.py", "bench/learning_cpu.py")
    for relative in callers:
        source = (REPO_ROOT / relative).read_text()
        assert "from beyond_agent.evaluation import" in source and "evaluate(" in source, relative
        assert "ParallelEnvManager(" not in source, relative
    agentevol = (REPO_ROOT / "recipe/agentevol/main.py").read_text()
    assert "from beyond_agent.collect import collect" in agentevol and "collect(policy" in agentevol
