"""Contract tests of every private method or attribute of verl and vLLM that our code overrides, replaces or calls,
of uvicorn's HTTP protocol class that envservice's transport subclasses, and of the requests / urllib3 pool hooks
its client uses (issue #54): each seam's upstream target must exist in the installed packages, and where we
override or replace a method, with the parameters our code is written against. A verl or vLLM upgrade that renames
a hook or changes its parameters then fails here, naming the seam, instead of failing a training run minutes in.

SEAMS is the list of them, with the file that touches each and why upstream does not offer it; moving them into one
seam module of the library is the rest of issue #54.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Seam:
    """One private touch of verl's or vLLM's surface."""

    upstream: str
    """"module:Attr.attr" of the upstream target."""
    ours: str | None
    """"module:Attr.attr" of our override or replacement, whose parameters after the instance (`self`, or the
    manager a replacement is bound to) must equal the target's (None: we only call or read the target)."""
    where: str
    """The file of ours that touches it."""
    why: str
    """What it does for us that no public hook does."""
    called_with: tuple[str, ...] = ()
    """Keyword arguments our code passes to the target (each must still be one of its parameters)."""


TRAINER = "recipe.multiturn_rl.trainer:BeyondAgentTrainer"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
SEAMS = (
    Seam(f"{RAY_TRAINER}._validate", f"{TRAINER}._validate", "recipe/multiturn_rl/trainer.py",
         "validation rollouts through our rollout manager (verl's validation calls its own agent loop)"),
    Seam(f"{RAY_TRAINER}._balance_batch", f"{TRAINER}._balance_batch", "recipe/multiturn_rl/trainer.py",
         "the join point after the rollout where our extra rows (agents' earlier segments) enter the batch"),
    Seam(f"{RAY_TRAINER}._compute_old_log_prob", f"{TRAINER}._compute_old_log_prob", "recipe/multiturn_rl/trainer.py",
         "async rollout: the behaviour policy's log-probs, and the rollout-vs-trainer log-prob gap metrics"),
    Seam(f"{RAY_TRAINER}._update_critic", f"{TRAINER}._update_critic", "recipe/multiturn_rl/trainer.py",
         "per-task advantage figures before the update"),
    Seam(f"{RAY_TRAINER}._update_actor", f"{TRAINER}._update_actor", "recipe/multiturn_rl/trainer.py",
         "keeps the actor's output for the weight sync's metrics"),
    Seam("verl.checkpoint_engine:CheckpointEngineManager.update_weights", None, "recipe/multiturn_rl/trainer.py",
         "replaced on the instance: the delta weight sync and the async rollout's version gate around verl's sync"),
    Seam("verl.trainer.sft_trainer:SFTTrainer._build_engine", None, "beyond_agent/dpo.py",
         "DPO: the loss function and the per-batch DPO metrics on verl's training client"),
    Seam("verl.trainer.sft_trainer:SFTTrainer._build_dataloader", None, "beyond_agent/dpo.py",
         "DPO: pair collation"),
    Seam("verl.trainer.sft_trainer:SFTTrainer._init_engine", None, "beyond_agent/dpo.py",
         "DPO: reference log-probs scored from the starting weights"),
    Seam("verl.workers.engine_workers:TrainingWorker.train_batch", None, "beyond_agent/dpo.py",
         "replaced on the instance: the per-micro-batch DPO figures averaged into one each", ("data",)),
    Seam("verl.workers.engine_workers:TrainingWorker.set_loss_fn", None, "beyond_agent/dpo.py",
         "DPO's loss on verl's training client", ("loss_fn",)),
    Seam("verl.workers.engine_workers:TrainingWorker.infer_batch", None, "beyond_agent/dpo.py",
         "DPO: the reference log-probs"),
    Seam("torch.distributed:init_process_group", None, "verl_cpu/platform.py",
         "wrapped on CPU: verl's backend string names gloo twice (cpu:gloo,cpu:gloo)", ("backend",)),
    Seam("verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension._update_weights",
         "beyond_agent.weights.vllm_extension:WeightSyncWorkerExtension._update_weights",
         "beyond_agent/weights/vllm_extension.py", "LoRA adapters loaded with vLLM's own name mapping"),
    Seam("verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension._iter_all_models", None,
         "beyond_agent/weights/vllm_extension.py", "delta sync: the models a full tensor is loaded into"),
    Seam("verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension._iter_all_models_with_config", None,
         "beyond_agent/weights/vllm_extension.py", "delta sync: processing weights after loading, as verl does"),
    Seam("vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
         "beyond_agent.weights.vllm_extension:load_adapter_from_tensors", "beyond_agent/weights/vllm_extension.py",
         "replaced on one manager: verl's TensorLoRARequest (an adapter as tensors) loaded like vLLM loads a folder"),
    Seam("verl.utils.vllm.vllm_quant_utils:is_fp8_model", None, "beyond_agent/weights/vllm_extension.py",
         "delta sync refuses quantized rollout weights (verl 0.9.1 renames it is_quantized_model)"),
    Seam("verl.utils.vllm.patch:patch_vllm_moe_model_weight_loader", None, "beyond_agent/weights/vllm_extension.py",
         "delta sync loads MoE weights as verl's own load does"),
    Seam("verl.utils.attention_utils:_get_attention_functions", None, "verl_cpu/platform.py",
         "replaced on CPU: verl's padding helpers without flash-attn (verl ships them in npu_flash_attn_utils)"),
    Seam("verl.utils.npu_flash_attn_utils:unpad_input", None, "verl_cpu/platform.py",
         "the torch-only padding helpers verl_cpu points verl at (pad_input, index_first_axis, rearrange beside it)"),
)


HTTP_PROTOCOL = "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol"
GUARDED = "envservice.transport:GuardedHttpToolsProtocol"
SEAMS += tuple(
    Seam(f"{HTTP_PROTOCOL}.{method}", f"{GUARDED}.{method}", "envservice/transport.py",
         "envservice's transport bounds each request's head and body, and each host's share, before the ASGI app "
         "(uvicorn has no hook between the socket and the parser)")
    for method in ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_url", "on_header",
                   "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                   "send_400_response")
) + (Seam(f"{HTTP_PROTOCOL}._unset_keepalive_if_required", None, "envservice/transport.py",
          "a refused request closes its connection as uvicorn's own refusals do"),)


IDLE_EXPIRING = "envservice.client:IdleExpiringAdapter"
SEAMS += (
    Seam("requests.adapters:HTTPAdapter.init_poolmanager", f"{IDLE_EXPIRING}.init_poolmanager", "envservice/client.py",
         "requests' hook for subclasses; ours sets the pool manager's `pool_classes_by_scheme` to pools of connections "
         "that expire when idle (neither requests nor urllib3 has an idle expiry)"),
    Seam("urllib3.connection:HTTPConnection.getresponse", "envservice.client:_IdleExpiring.getresponse",
         "envservice/client.py", "when a connection was last answered, for its idle expiry"),
    Seam("urllib3.util.connection:is_connection_dropped", None, "envservice/client.py",
         "how a urllib3 pool asks a connection's `is_connected` before reusing it, which ours answers False once idle"),
)


def resolve(path: str):
    """The object at "module:Attr.attr"; AttributeError / ImportError name what is missing."""
    module_name, _, attributes = path.partition(":")
    target = importlib.import_module(module_name)
    for name in attributes.split("."):
        target = getattr(target, name)
    return target


def parameters(method) -> list[str]:
    """A method's parameter names after the instance's."""
    return list(inspect.signature(method).parameters)[1:]


def seam_problem(seam: Seam) -> str | None:
    """What breaks the seam in the installed packages, or None."""
    try:
        target = resolve(seam.upstream)
    except (ImportError, AttributeError) as missing:
        return f"{seam.upstream} (used by {seam.where}: {seam.why}) is gone: {missing}"
    if not callable(target):
        return f"{seam.upstream} is no longer callable"
    missing = [name for name in seam.called_with if name not in inspect.signature(target).parameters]
    if missing:
        return f"{seam.upstream} no longer takes {missing}, which {seam.where} passes"
    if seam.ours is not None:
        theirs, mine = parameters(target), parameters(resolve(seam.ours))
        if theirs != mine:
            return f"{seam.upstream} takes {theirs}; our {seam.ours} ({seam.where}) is written for {mine}"
    return None


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.upstream.split(":")[1])
def test_each_seam_exists_with_the_parameters_we_are_written_for(seam):
    assert seam_problem(seam) is None, seam_problem(seam)


def seam_named(name: str) -> Seam:
    """The seam whose upstream target ends with `name`."""
    return next(seam for seam in SEAMS if seam.upstream.endswith(name))


def test_a_renamed_or_changed_upstream_hook_is_named(monkeypatch):
    """What an upgrade that renames a hook or changes its parameters looks like here (the target changed in this
    process, as a new release would change it)."""
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    monkeypatch.delattr(ray_trainer.RayPPOTrainer, "_balance_batch")
    assert "RayPPOTrainer._balance_batch (used by recipe/multiturn_rl/trainer.py: the join point" in \
        seam_problem(seam_named("._balance_batch"))
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_update_actor", lambda self, batch, metrics: None)
    assert seam_problem(seam_named("._update_actor")) == (f"{RAY_TRAINER}._update_actor takes ['batch', 'metrics']; our "
                                      f"{TRAINER}._update_actor (recipe/multiturn_rl/trainer.py) is written for "
                                      "['batch']")
    quant_utils = importlib.import_module("verl.utils.vllm.vllm_quant_utils")
    monkeypatch.delattr(quant_utils, "is_fp8_model")  # what verl 0.9.1 does (renamed is_quantized_model)
    assert "is_fp8_model (used by beyond_agent/weights/vllm_extension.py" in seam_problem(seam_named(":is_fp8_model"))
    worker = importlib.import_module("verl.workers.engine_workers")
    monkeypatch.setattr(worker.TrainingWorker, "set_loss_fn", lambda self, fn: None)  # a renamed keyword
    assert seam_problem(seam_named(".set_loss_fn")) == ("verl.workers.engine_workers:TrainingWorker.set_loss_fn no longer "
                                                  "takes ['loss_fn'], which beyond_agent/dpo.py passes")
