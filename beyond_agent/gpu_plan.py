"""GPU memory and layout of a run, estimated from its composed config before anything starts.

Why: the ways a 7B multi-turn run fails on GPUs are visible in the config, but only hours in. A
micro-batch of 2 sequences of 18 k tokens is 37 k tokens in one forward: its logits alone (vocabulary
152 064) are 11 GB in bf16, next to the memory vLLM keeps when `free_cache_engine=false` (async rollout)
and the FSDP state. `plan` adds up the big items for one GPU and `problems` names what does not fit:

- the actor's two forwards, each of the tokens of one micro-batch (sequences x (prompt + response) without
  dynamic batch size, else its token budget, at least one whole sequence): the update's holds its logits,
  their gradient and a working copy (tokens x vocabulary x 6 bytes) plus the checkpointed activations
  (tokens x hidden x layers x 2 bytes); the log-prob forward (no gradient) its bf16 logits and an fp32
  log-softmax (x 4 bytes);
- the FSDP state: parameters x 16 bytes (fp32 weights, gradients, two Adam moments) over the GPUs, unless
  offloaded;
- vLLM's share (`gpu_memory_utilization`), counted while the actor trains only when the rollout keeps it
  (`free_cache_engine=false`);
- the layout: rollout tensor parallelism must divide the GPUs (replicas x TP = GPUs);
- throughput (`notes`, advice rather than a problem): `beyond_agent.concurrency` requests in flight are
  shared by all rollout replicas, so 64 over 4 replicas keeps 16 on each while vLLM could batch
  `rollout.max_num_seqs` (256): generation then waits on latency. Slow, not wrong.

These are estimates of the largest items, not a profile: a plan within budget can still run out of memory,
but one over budget will. The model's shape comes from its `config.json` when the path is a local folder,
else from `KNOWN_MODELS` (hub names, since nothing is downloaded here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

GIB = 1 << 30
GPU_PLAN_WARNING = "[beyond_agent] warning (GPU memory estimate):"
"""How a training entry prints each problem of its plan (the launcher's dry run repeats these lines)."""
GPU_PLAN_NOTE = "[beyond_agent] note (GPU throughput estimate):"
"""How a training entry prints each of the plan's notes."""
FEW_REQUESTS_PER_REPLICA = 32
"""Below this many requests in flight per rollout replica (while a step has more episodes to play) the plan
notes that generation is latency-bound."""
SUGGESTED_REQUESTS_PER_REPLICA = 64
HEADROOM = 0.9
"""Share of the GPU's memory a plan may use (the rest: CUDA context, allocator fragmentation, buffers)."""
UPDATE_LOGIT_BYTES = 2 + 2 + 2
"""Per token and vocabulary entry in the update: bf16 logits, their gradient, one working copy (softmax, entropy)."""
LOG_PROB_LOGIT_BYTES = 2 + 4
"""Per token and vocabulary entry in the log-prob forward: bf16 logits and their fp32 log-softmax."""
FSDP_BYTES_PER_PARAM = 4 + 4 + 8
"""fp32 weights, fp32 gradients, Adam's two fp32 moments."""
FROZEN_BYTES_PER_PARAM = 4
"""LoRA (`actor_rollout_ref.model.lora_rank > 0`): the base's fp32 weights only, it has no gradient or optimizer
state (the adapter's own state, 0.5-7 % of the parameters x 16 bytes at ranks 16-64, is left out)."""


@dataclass(frozen=True)
class ModelShape:
    """The parts of a causal LM's `config.json` the plan needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config_json(cls, values: Mapping[str, Any]) -> "ModelShape":
        """From a Hugging Face `config.json` (its field names)."""
        return cls(hidden_size=int(values["hidden_size"]), intermediate_size=int(values["intermediate_size"]),
                   num_hidden_layers=int(values["num_hidden_layers"]),
                   num_attention_heads=int(values["num_attention_heads"]),
                   num_key_value_heads=int(values.get("num_key_value_heads", values["num_attention_heads"])),
                   vocab_size=int(values["vocab_size"]), tie_word_embeddings=bool(values.get("tie_word_embeddings")))

    @property
    def parameters(self) -> int:
        """Parameter count of a Llama/Qwen2-style decoder (attention with q/k/v biases, SwiGLU MLP, RMSNorm)."""
        head_dim = self.hidden_size // self.num_attention_heads
        kv = self.num_key_value_heads * head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv + self.hidden_size + 2 * kv
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size


KNOWN_MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B-Instruct": ModelShape(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(3584, 18944, 28, 28, 4, 152064, False),
}
"""Shapes of hub models the examples name (from their config.json files), by name."""


def model_shape(path: str) -> ModelShape | None:
    """The shape of the model at `path`: its config.json when local, else `KNOWN_MODELS`; None if unknown."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return ModelShape.from_config_json(json.loads(config_file.read_text()))
    return KNOWN_MODELS.get(path)


@dataclass(frozen=True)
class GpuPlan:
    """The estimated per-GPU memory of a run's largest items (GiB) and its layout."""

    gpus: int
    rollout_tp: int
    update_tokens: int
    """Tokens in one micro-batch of the actor update on one GPU."""
    log_prob_tokens: int
    """Tokens in one micro-batch of the log-prob forward (old log-probs; the reference follows it)."""
    update_gib: float
    """The update's logits, their gradient and working copy, and its checkpointed activations."""
    log_prob_gib: float
    fsdp_state_gib: float
    vllm_kept_gib: float
    """vLLM's memory while the actor trains (0 when the rollout frees it)."""
    gpu_gib: float
    concurrency: int = 0
    """`beyond_agent.concurrency`: episodes and generation requests in flight, over all replicas (0: unknown)."""
    episodes_per_step: int = 0
    """data.train_batch_size x rollout.n."""
    max_num_seqs: int = 256
    """What one vLLM replica batches at most (`rollout.max_num_seqs`)."""

    @property
    def rollout_replicas(self) -> int:
        """vLLM servers: GPUs / rollout TP."""
        return max(self.gpus // max(self.rollout_tp, 1), 1)

    @property
    def training_peak_gib(self) -> float:
        """What one GPU holds at the larger of the actor's two forwards."""
        return max(self.update_gib, self.log_prob_gib) + self.fsdp_state_gib + self.vllm_kept_gib

    def problems(self) -> list[str]:
        """What does not fit, each naming the keys to change; [] when the plan fits."""
        found = []
        if self.gpus % self.rollout_tp:
            found.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp} does not divide the "
                         f"{self.gpus} GPUs (trainer.nnodes x trainer.n_gpus_per_node): replicas x TP must equal them")
        budget = HEADROOM * self.gpu_gib
        if self.training_peak_gib > budget:
            found.append(
                f"the actor needs about {self.training_peak_gib:.0f} GiB of a {self.gpu_gib:.0f} GiB GPU (budget "
                f"{budget:.0f}): {self.summary()}. Set actor_rollout_ref.actor.use_dynamic_bsz=true with a token "
                "budget (actor.ppo_max_token_len_per_gpu, rollout.log_prob_max_token_len_per_gpu), smaller "
                "micro-batches, or a lower rollout.gpu_memory_utilization")
        return found

    def notes(self) -> list[str]:
        """Advice on throughput (the run works without it); [] when none applies."""
        per_replica = self.concurrency / self.rollout_replicas
        if not self.concurrency or per_replica >= FEW_REQUESTS_PER_REPLICA or self.episodes_per_step <= self.concurrency:
            return []
        suggested = min(self.episodes_per_step, self.rollout_replicas * SUGGESTED_REQUESTS_PER_REPLICA)
        return [f"beyond_agent.concurrency={self.concurrency} over {self.rollout_replicas} rollout replicas keeps about "
                f"{per_replica:.0f} requests in flight on each, while a step plays {self.episodes_per_step} episodes "
                f"and a replica batches up to {self.max_num_seqs} (rollout.max_num_seqs): generation will wait on "
                f"latency. Consider beyond_agent.concurrency={suggested} if envservice has the memory for that many "
                "sessions at once (bench/env_memory.py measures an env's memory per session)"]

    def summary(self) -> str:
        """One line of the figures."""
        return (f"{self.gpus} GPUs, rollout TP {self.rollout_tp}; update {self.update_tokens} tokens "
                f"{self.update_gib:.1f} GiB, log-prob {self.log_prob_tokens} tokens {self.log_prob_gib:.1f} GiB, "
                f"FSDP state {self.fsdp_state_gib:.1f}, vLLM kept {self.vllm_kept_gib:.1f}: peak "
                f"{self.training_peak_gib:.1f} GiB of {self.gpu_gib:.0f}")


def plan(config: Any, model: ModelShape, gpu_gib: float = 80.0) -> GpuPlan:
    """The plan of a composed, resolved verl config (actor_rollout_ref, data, trainer) for `model`."""
    actor, rollout, data = config["actor_rollout_ref"]["actor"], config["actor_rollout_ref"]["rollout"], config["data"]
    gpus = int(config["trainer"]["nnodes"]) * int(config["trainer"]["n_gpus_per_node"])
    sequence = int(data["max_prompt_length"]) + int(data["max_response_length"])
    update = _forward_tokens(actor.get("use_dynamic_bsz"), actor.get("ppo_max_token_len_per_gpu"),
                             actor.get("ppo_micro_batch_size_per_gpu"), sequence)
    log_prob = _forward_tokens(rollout.get("log_prob_use_dynamic_bsz"), rollout.get("log_prob_max_token_len_per_gpu"),
                               rollout.get("log_prob_micro_batch_size_per_gpu"), sequence)
    fsdp = actor.get("fsdp_config") or {}
    offloaded = bool(fsdp.get("param_offload")) and bool(fsdp.get("optimizer_offload"))
    lora = lora_rank(config["actor_rollout_ref"].get("model") or {}) > 0
    state_bytes = FROZEN_BYTES_PER_PARAM if lora else FSDP_BYTES_PER_PARAM
    keeps_cache = not bool(rollout.get("free_cache_engine", True))
    activations = update * model.hidden_size * model.num_hidden_layers * 2
    return GpuPlan(
        gpus=gpus, rollout_tp=int(rollout.get("tensor_model_parallel_size") or 1), update_tokens=update,
        log_prob_tokens=log_prob, update_gib=(update * model.vocab_size * UPDATE_LOGIT_BYTES + activations) / GIB,
        log_prob_gib=log_prob * model.vocab_size * LOG_PROB_LOGIT_BYTES / GIB,
        fsdp_state_gib=0.0 if offloaded else model.parameters * state_bytes / max(gpus, 1) / GIB,
        vllm_kept_gib=float(rollout.get("gpu_memory_utilization") or 0.0) * gpu_gib if keeps_cache else 0.0,
        gpu_gib=gpu_gib, concurrency=int((config.get("beyond_agent") or {}).get("concurrency") or 0),
        episodes_per_step=int(data.get("train_batch_size") or 0) * int(rollout.get("n") or 1),
        max_num_seqs=int(rollout.get("max_num_seqs") or 256))


def lora_rank(model: Any) -> int:
    """A run's LoRA rank from its `actor_rollout_ref.model` section (0: full fine-tuning): verl reads
    `lora_rank`, or `lora.rank` (Megatron)."""
    return max(int(model.get("lora_rank", 0) or 0), int((model.get("lora") or {}).get("rank", 0) or 0))


def _forward_tokens(dynamic: Any, max_tokens: Any, micro_batch: Any, sequence: int) -> int:
    """Tokens of one micro-batch: the token budget with dynamic batch size (at least one whole sequence),
    else sequences x their longest length."""
    if dynamic:
        return max(int(max_tokens), sequence)
    return int(micro_batch or 1) * sequence
