"""The seams to verl, vLLM, uvicorn, urllib3 and torch (`beyond_agent.seams.SEAMS`, issue #54): every private method
or attribute our code overrides, replaces or calls must exist in the installed packages, with the parameters our
override is written for and the keywords our calls pass. A verl or vLLM upgrade that renames a hook or changes its
parameters then fails here, naming the seam, instead of failing a training run minutes in. Our code touches no
upstream surface the registry does not list (private reads, calls, overrides, assignments, patches of public names:
found by walking our code, `beyond_agent.seams.touches`), and verl's trainer helpers are overridden in
`beyond_agent.seams.trainer` alone; `patch` refuses an attribute that is gone or not registered.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import pytest

from beyond_agent.seams import OVERRIDE, PATCH, READ, SEAMS, Seam, SeamMissing, patch, resolve, seam_problem
from beyond_agent.seams.touches import OUR_PACKAGES, our_sources, touches, unlisted

RAY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
TRAINER_SEAMS = "beyond_agent.seams.trainer:TrainerSeams"


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_each_seam_exists_with_the_parameters_we_are_written_for(seam):
    assert seam_problem(seam) is None, seam_problem(seam)


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.name)
def test_each_seam_names_code_of_ours_that_exists(seam):
    module = seam.ours.partition(":")[0]
    assert module.split(".")[0] in OUR_PACKAGES
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


def test_a_shadowed_builtin_holds_while_the_module_calls_it_and_is_named_when_it_stops(tmp_path, monkeypatch):
    (tmp_path / "fake_printing.py").write_text("def draw():\n    print('Sampling rejected')\n")
    (tmp_path / "fake_quiet.py").write_text("def draw():\n    logger.print_stats('Sampling rejected')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def seam(module: str) -> Seam:
        return Seam(f"{module}:print", PATCH, "envservice.envs.babyai:_log_generator_line", "why", "upstream",
                    shadows_builtin=True)

    assert seam_problem(seam("fake_printing")) is None
    assert seam_problem(seam("fake_quiet")) == (
        "fake_quiet:print (used by envservice.envs.babyai:_log_generator_line: why) is no longer called by fake_quiet")


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


@pytest.fixture(scope="module")
def our_touches():
    """Every touch of upstream surface in our code (`beyond_agent.seams.touches`), found once."""
    return touches(our_sources(Path(".")))


def test_every_touch_of_upstream_surface_in_our_code_is_a_registered_seam(our_touches):
    """Issue #73: reads, calls, overrides (with or without super()), assignments and patches of upstream modules'
    public names, found by walking our code: each must be listed. (Before, only overrides that call super() and
    `obj._x = ...` were checked, and verl's `_get_zmq_handle`, `BaseEngine.to(self, ...)`, τ²'s `_execute_tool` and
    TextArena's `random` swap passed unlisted.)"""
    assert [str(touch) for touch in unlisted(our_touches)] == []
    # verl's trainer helpers are overridden in one place: the recipe's trainer fills TrainerSeams' hooks.
    helpers = {seam.name.partition(".")[2] for seam in SEAMS if seam.name.startswith("RayPPOTrainer.")}
    overriding = {touch.module for touch in our_touches if touch.kind == OVERRIDE and touch.name in helpers}
    assert len(helpers) == 6 and overriding == {"beyond_agent.seams.trainer"}
    # One seam shape: verl's SFT trainer's build steps too are overridden in one place, as hooks (DPO fills them).
    sft_steps = {seam.name.partition(".")[2] for seam in SEAMS if seam.name.startswith("SFTTrainer._")}
    overriding = {touch.module for touch in our_touches if touch.kind == OVERRIDE and touch.name in sft_steps}
    assert len(sft_steps) == 3 and overriding == {"beyond_agent.seams.sft_trainer"}


UNLISTED_TOUCHES = '''
import importlib
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.workers.rollout.vllm_rollout import utils as vllm_utils


class Sneaky(RayPPOTrainer):
    def _validate(self):  # an override without super()
        return {}

    def run(self, handle):
        handle._engine_core.shutdown()          # a private read of an upstream object
        return RayPPOTrainer.fit(self)           # past every override between


def swap(rng):
    vllm_utils.VLLM_LORA_INT_ID = 7              # a public name of an upstream module, replaced
    module = importlib.import_module("textarena.envs.Mastermind.env")
    module.random = rng                          # a module got at run time
    setattr(RayPPOTrainer, "_save_checkpoint", None)
'''


def test_an_unlisted_touch_of_each_kind_fails_the_check(our_touches):
    """The check shown failing: a module of ours with one unlisted touch of each kind is named, each touch with its
    line, kind and code."""
    found = touches([("beyond_agent.sneaky", ast.parse(UNLISTED_TOUCHES))])
    assert sorted((touch.line, touch.kind, touch.name) for touch in unlisted(found)) == [
        (8, OVERRIDE, "_validate"), (12, READ, "_engine_core"), (13, READ, "fit"), (17, PATCH, "VLLM_LORA_INT_ID"),
        (19, PATCH, "random"), (20, PATCH, "_save_checkpoint")]
