"""The seams to verl, vLLM, uvicorn, urllib3 and torch (`beyond_agent.seams.SEAMS`, issue #54): every private method
or attribute our code overrides, replaces or calls must exist in the installed packages, with the parameters our
override is written for and the keywords our calls pass. A verl or vLLM upgrade that renames a hook or changes its
parameters then fails here, naming the seam, instead of failing a training run minutes in. Our code overrides or
replaces no private upstream attribute the registry does not list, and verl's trainer helpers are overridden in
`beyond_agent.seams.trainer` alone; `patch` refuses an attribute that is gone or not registered.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import pytest

from beyond_agent.seams import OVERRIDE, PATCH, READ, SEAMS, Seam, SeamMissing, patch, resolve, seam_problem

RAY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
TRAINER_SEAMS = "beyond_agent.seams.trainer:TrainerSeams"
ROOTS = ("beyond_agent", "recipe", "verl_cpu", "envservice", "sandbox", "launch", "dev_tools")


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_each_seam_exists_with_the_parameters_we_are_written_for(seam):
    assert seam_problem(seam) is None, seam_problem(seam)


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_each_seam_names_code_of_ours_that_exists(seam):
    module = seam.ours.partition(":")[0]
    assert module.split(".")[0] in ROOTS
    resolve(seam.ours)


def seam_named(name: str) -> Seam:
    """The seam whose upstream target ends with `name`."""
    return next(seam for seam in SEAMS if seam.upstream.endswith(name))


def test_a_renamed_or_changed_upstream_hook_is_named(monkeypatch):
    """What an upgrade that renames a hook or changes its parameters looks like here (the target changed in this
    process, as a new release would change it)."""
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    monkeypatch.delattr(ray_trainer.RayPPOTrainer, "_balance_batch")
    assert f"RayPPOTrainer._balance_batch (used by {TRAINER_SEAMS}._balance_batch: the join point" in \
        seam_problem(seam_named("._balance_batch"))
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_update_actor", lambda self, batch, metrics: None)
    assert seam_problem(seam_named("._update_actor")) == (
        f"{RAY_TRAINER}._update_actor takes ['batch', 'metrics']; our {TRAINER_SEAMS}._update_actor is written for "
        "['batch']")
    quant_utils = importlib.import_module("verl.utils.vllm.vllm_quant_utils")
    monkeypatch.delattr(quant_utils, "is_fp8_model")  # what verl 0.9.1 does (renamed is_quantized_model)
    assert "is_fp8_model (used by beyond_agent.weights.vllm_extension" in seam_problem(seam_named(":is_fp8_model"))
    worker = importlib.import_module("verl.workers.engine_workers")
    monkeypatch.setattr(worker.TrainingWorker, "set_loss_fn", lambda self, fn: None)  # a renamed keyword
    assert seam_problem(seam_named(".set_loss_fn")) == (
        "verl.workers.engine_workers:TrainingWorker.set_loss_fn no longer takes ['loss_fn'], which "
        "beyond_agent.dpo:dpo_trainer_class passes")


@pytest.fixture
def upstream(tmp_path, monkeypatch):
    """A module `fake_upstream` standing for a package we hook: `Engine` with a private method and an attribute it
    sets on each instance."""
    (tmp_path / "fake_upstream.py").write_text(textwrap.dedent("""
        class Engine:
            def __init__(self):
                self._manager = object()

            def _step(self, batch, metrics):
                return batch
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_upstream"


def test_the_check_reads_instance_attributes_and_kinds(upstream):
    def seam(target: str, kind: str = READ) -> Seam:
        return Seam(target, kind, "beyond_agent.seams:patch", "why", "upstream", instance_attribute=True)

    assert seam_problem(seam("fake_upstream:Engine._manager")) is None
    assert seam_problem(seam("fake_upstream:Engine._adapters")) == (
        "fake_upstream:Engine._adapters (used by beyond_agent.seams:patch: why) is no longer set by Engine")
    assert "kind 'wrap' is not one of" in seam_problem(seam("fake_upstream:Engine._manager", "wrap"))


def test_patch_replaces_a_registered_attribute_and_refuses_a_missing_or_unregistered_one():
    class Manager:
        def update_weights(self, global_steps=None):
            return "verl's"

    manager = Manager()
    original = patch(manager, "update_weights", lambda global_steps=None: "ours")
    assert manager.update_weights() == "ours" and original() == "verl's"
    with pytest.raises(SeamMissing, match="Manager has no attribute '_load_adapter' to replace"):
        patch(manager, "_load_adapter", None)  # renamed upstream: nothing would call ours
    manager.flush = lambda: None
    with pytest.raises(KeyError, match="'flush' is not a registered seam"):
        patch(manager, "flush", None)


def our_sources():
    """(module name, syntax tree) of every Python file of ours."""
    for root in ROOTS:
        for path in sorted(Path(root).rglob("*.py")):
            yield ".".join(path.with_suffix("").parts).removesuffix(".__init__"), ast.parse(path.read_text())


def private_overrides(tree: ast.Module):
    """(class, method) of every method `_x` that calls `super()._x`: a class of ours overriding a private method."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name.startswith("_") and not item.name.startswith("__"):
                if any(isinstance(call, ast.Attribute) and call.attr == item.name and isinstance(call.value, ast.Call)
                       and isinstance(call.value.func, ast.Name) and call.value.func.id == "super"
                       for call in ast.walk(item)):
                    yield node.name, item.name


def private_assignments(tree: ast.Module):
    """Names `_x` assigned as `something._x = ...` where something is not `self` or `cls`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and target.attr.startswith("_")
                        and not target.attr.startswith("__")
                        and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))):
                    yield target.attr


def names_defined_by_our_classes(sources) -> set[str]:
    """Attributes our own classes define or set on themselves (setting those on another object of ours is no seam)."""
    names = set()
    for _, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, ast.Assign):
                names |= {target.attr for target in node.targets if isinstance(target, ast.Attribute)
                          and isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")}
    return names


def test_every_private_override_and_replacement_in_our_code_is_a_registered_seam():
    sources = list(our_sources())
    our_classes = {node.name for _, tree in sources for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    ours = names_defined_by_our_classes(sources)
    registered = {(seam.ours.partition(":")[0], seam.name.rpartition(".")[2], seam.kind) for seam in SEAMS}
    unregistered = []
    for module, tree in sources:
        bases = {node.name: [ast.unparse(base).rpartition(".")[2] for base in node.bases] for node in ast.walk(tree)
                 if isinstance(node, ast.ClassDef)}
        for cls, method in private_overrides(tree):
            if not set(bases[cls]) <= our_classes and (module, method, OVERRIDE) not in registered:
                unregistered.append(f"{module}:{cls}.{method} overrides an upstream private method")
        for attribute in private_assignments(tree):
            if attribute not in ours and (module, attribute, PATCH) not in registered:
                unregistered.append(f"{module} sets {attribute} on an upstream object")
    assert unregistered == []
    # verl's trainer helpers are overridden in one place: the recipe's trainer fills TrainerSeams' hooks.
    helpers = {seam.name.partition(".")[2] for seam in SEAMS if seam.name.startswith("RayPPOTrainer.")}
    overriding = {module for module, tree in sources for _, method in private_overrides(tree) if method in helpers}
    assert len(helpers) == 5 and overriding == {"beyond_agent.seams.trainer"}
