"""Play a policy on a set of tasks and score it: the one evaluation API.

    with serve_policy(PolicyConfig(model="outputs/model", backend="hf", temperature=0.0)) as policy, \\
            EnvClient(url) as env:
        evaluation = evaluate(policy, env, TaskSet.of("held-out", "frozenlake", "test", range(64)), limits)
        evaluation.require_complete()          # an env or LLM failure is never a failed episode
        print(evaluation.success_rate)

The collection CLI (`beyond_agent/collect.py`), the learning bench, AgentEvol and Agent-R all score
models with `evaluate`; each episode runs through the same EpisodeLoop training uses, so a figure measured
here is measured the way training plays.

A set of tasks is `envservice.contamination.TaskSet` (env, split, (task index, seed) pairs, params): the same
object the held-out checks fingerprint, so what is evaluated is what was checked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeResult, EpisodeSpec, GenerateFn, place_seeds
from beyond_agent.rollout.env_manager import ParallelEnvManager, RolloutMetrics
from beyond_agent.tasks import AgentTask, EnvTask
from envservice.contamination import TaskSet

POLICY_BACKENDS = ("vllm", "hf")
"""vllm: a vLLM server (given URLs, or one started for the model); hf: the model in this process."""


@dataclass(frozen=True)
class PolicyConfig:
    """Which model plays, and how it is served."""

    model: str
    """Hugging Face model folder (or, with `vllm_urls`, the name the servers know it by, unless
    `served_model_name` says otherwise)."""
    backend: str = "vllm"
    """One of POLICY_BACKENDS."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    seed: int = 0
    """The sampling seed, so sampled figures repeat: torch's before in-process (hf) sampling; on vLLM each
    request's derives from it (`Policy.sampling_seed`)."""
    vllm_urls: tuple[str, ...] = ()
    """Running vLLM servers to use; empty: start one for `model` (and stop it after)."""
    served_model_name: str | None = None
    """The model's name on `vllm_urls` (default: `model`)."""
    max_model_len: int = 4096
    """Context length of a vLLM server we start."""
    max_in_flight: int = 32
    """Generations in flight at once on vLLM (in-process generation plays one episode at a time)."""

    def __post_init__(self) -> None:
        if self.backend not in POLICY_BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown; valid backends: {', '.join(POLICY_BACKENDS)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass
class Policy:
    """A served model: its generate function, how many episodes it can play at once, and its LLM front."""

    generate: GenerateFn
    """generate(request_id, prompt_ids, max_tokens) -> the turn (EpisodeLoop's contract)."""
    concurrency: int
    """Episodes worth playing at once: 1 in process, `max_in_flight` on vLLM."""
    llm: Any = None
    """The `AsyncLLMServerManager` behind `generate` on vLLM (its metrics), None in process."""
    sampling_seed: int | None = None
    """On vLLM, `PolicyConfig.seed`: each episode's turns sample with seeds from it and the episode's place
    (`rollout.episode_loop.place_seeds`); None in process, where `torch.manual_seed` seeds the sampling."""


@contextlib.contextmanager
def serve_policy(config: PolicyConfig, log: Callable[[str], None] = print) -> Iterator[Policy]:
    """The model of `config`, served for the `with` block (a vLLM server we start is stopped after it)."""
    if config.backend == "hf":
        import torch

        from beyond_agent.rollout.hf_policy import TransformersPolicy

        torch.manual_seed(config.seed)
        yield Policy(TransformersPolicy.from_pretrained(config.model, config.temperature), concurrency=1)
        return
    from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, LLMManagerConfig, SamplingParams

    with _vllm_urls(config, log) as urls, \
            AsyncLLMServerManager(HttpVLLMBackend(list(urls), config.served_model_name or config.model),
                                  LLMManagerConfig(max_in_flight=config.max_in_flight)) as llm:
        yield Policy(llm.with_sampling(SamplingParams(temperature=config.temperature)),
                     concurrency=config.max_in_flight, llm=llm, sampling_seed=config.seed)


@contextlib.contextmanager
def _vllm_urls(config: PolicyConfig, log: Callable[[str], None]) -> Iterator[tuple[str, ...]]:
    if config.vllm_urls:
        yield config.vllm_urls
        return
    from beyond_agent.serving import VLLMServer, VLLMServerConfig

    log(f"starting vLLM for {config.model} ...")
    with VLLMServer(VLLMServerConfig(model=config.model, max_model_len=config.max_model_len)) as server:
        log(f"vLLM ready at {server.base_url} after {server.startup_seconds:.0f} s")
        yield (server.base_url,)


class EvaluationIncomplete(RuntimeError):
    """An episode ended in an infrastructure failure (env, LLM, timeout): the figure would not be the model's."""


@dataclass
class Evaluation:
    """Every episode of one evaluation, in task order (`samples` per task, consecutive), and their figures."""

    tasks: TaskSet
    results: list[EpisodeResult]
    metrics: RolloutMetrics
    """Success and reward over the scored episodes; terminations, times and infra failures over all."""

    @property
    def scored(self) -> list[EpisodeResult]:
        """The episodes that ended for a reason of the policy's or the env's making (no infra failure)."""
        return [result for result in self.results if not result.infra_failure]

    @property
    def success_rate(self) -> float:
        """Mean success of the scored episodes (0 when none was scored)."""
        return self.metrics.success_rate

    def require_complete(self) -> "Evaluation":
        """This evaluation, or `EvaluationIncomplete` naming the first episode an infra failure ended."""
        for result in self.results:
            if result.infra_failure:
                raise EvaluationIncomplete(
                    f"{self.tasks.name} ({self.tasks.env_id} {self.tasks.split}) task {result.spec.task_id}: "
                    f"{result.termination}: {result.error} ({len(self.results) - len(self.scored)} of "
                    f"{len(self.results)} episodes failed so)")
        return self


@dataclass(frozen=True)
class EvaluationConfig:
    """How each task is played: episodes per task, the limits of each, and the AgentTask that scores them."""

    limits: EpisodeConfig
    max_rounds: int
    """Assistant turns per episode at most."""
    samples: int = 1
    """Episodes per task (one group: they share the task's seed)."""
    agent_task: AgentTask = field(default_factory=EnvTask)
    """How the episodes are prompted, parsed and scored (default: the env's own reward)."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")


def episode_specs(tasks: TaskSet, samples: int = 1, agent_task: AgentTask | None = None) -> list[EpisodeSpec]:
    """`samples` episodes per task of the set, in task order; the samples of one task form one group."""
    agent_task = agent_task or EnvTask()
    return [EpisodeSpec(tasks.env_id, task_id=index, seed=seed, split=tasks.split, params=dict(tasks.params),
                        group_id=f"{tasks.env_id}:{index}", index=position * samples + sample, agent_task=agent_task)
            for position, (index, seed) in enumerate(tasks.tasks) for sample in range(samples)]


def evaluate(policy: Policy, env: Any, tasks: TaskSet, settings: EvaluationConfig, tokenizer: Any,
             on_result: Callable[[EpisodeResult], None] | None = None) -> Evaluation:
    """Play every task of `tasks` `settings.samples` times with `policy` on `env` (an `envservice.EnvClient`),
    `policy.concurrency` episodes at once, each through the rollout's EpisodeLoop; the episodes and figures.

    With one episode at a time the episodes run in task order, so an in-process sampled policy draws the
    same random numbers on every run (the seed is `PolicyConfig.seed`); on vLLM each request has its own seed."""
    manager = ParallelEnvManager(env, policy.generate, tokenizer, settings.limits, max_workers=policy.concurrency)
    specs = place_seeds(episode_specs(tasks, settings.samples, settings.agent_task), policy.sampling_seed, "evaluate")
    output = manager.run(specs, settings.max_rounds, on_result=on_result)
    return Evaluation(tasks, output.results, output.metrics)
