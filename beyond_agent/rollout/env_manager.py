"""ParallelEnvManager: one EpisodeLoop per episode in a thread pool, sharing one LLM front and one env client.

Why threads: an episode spends its time waiting, on the environment service (blocking HTTP) or on the
LLM server; threads let hundreds of episodes wait at once, so the LLM server always has work and no
episode waits for the slowest one (no lock-step turns). LLM calls go to the one event loop owned by the
LLM front (`AsyncLLMServerManager`); environment calls are plain blocking I/O in the episode's thread.

Each episode's AgentTask (on its EpisodeSpec) prompts, parses and scores it, so one call can mix
environments and tasks. Infrastructure failures (`env_error`, `llm_error`, `timeout`) are not reward: they
are counted here and kept out of training by `rollout/batch.py`.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from beyond_agent.rollout.episode_loop import EpisodeLoop, EpisodeConfig, EpisodeResult, EpisodeSpec, GenerateFn, seeded


@dataclass
class RolloutMetrics:
    """Figures for one call of the manager (logged with verl's tracker in training)."""

    episodes: int
    success_rate: float
    mean_reward: float
    mean_rounds: float
    terminations: dict[str, int]
    env_time_s: float
    """Sum over episodes of time spent in environment calls."""
    llm_time_s: float
    """Sum over episodes of time spent waiting for generations."""
    wall_time_s: float
    infra_failures: int

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat scalar metrics, e.g. for verl's tracker."""
        flat = {f"{prefix}{k}": float(v) for k, v in vars(self).items() if k != "terminations"}
        flat.update({f"{prefix}termination/{k}": float(v) for k, v in self.terminations.items()})
        return flat


@dataclass
class RolloutOutput:
    """Results in batch order, plus their metrics."""

    results: list[EpisodeResult]
    metrics: RolloutMetrics
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(results: Sequence[EpisodeResult], wall_time_s: float) -> RolloutMetrics:
    """Metrics over finished episodes; success and reward are averaged over non-failed episodes only."""
    scored = [r for r in results if not r.infra_failure]
    count = max(len(scored), 1)
    return RolloutMetrics(
        episodes=len(results),
        success_rate=sum(r.success for r in scored) / count,
        mean_reward=sum(r.reward for r in scored) / count,
        mean_rounds=sum(r.rounds for r in results) / max(len(results), 1),
        terminations=dict(Counter(r.termination for r in results)),
        env_time_s=sum(r.env_time_s for r in results),
        llm_time_s=sum(r.llm_time_s for r in results),
        wall_time_s=wall_time_s,
        infra_failures=len(results) - len(scored),
    )


class ParallelEnvManager:
    """Runs a batch of episodes concurrently; see the module docstring.

    Args:
        env_client: an `envservice.EnvClient` (thread-safe; size its pool to `max_workers`).
        generate: generate(request_id, prompt_ids, max_tokens) -> turn with token_ids and logprobs; in
            practice `AsyncLLMServerManager.with_sampling(sampling)`.
        tokenizer: the policy's tokenizer (its chat template builds every prompt).
        config: the limits every episode shares (each call gives its round limit).
        max_workers: episodes in flight at once.
    """

    def __init__(self, env_client: Any, generate: GenerateFn, tokenizer: Any, config: EpisodeConfig,
                 max_workers: int = 64):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.env_client = env_client
        self.generate = generate
        self.tokenizer = tokenizer
        self.config = config
        self.max_workers = max_workers

    def episode_loop(self, spec: EpisodeSpec, max_rounds: int) -> EpisodeLoop:
        """The EpisodeLoop for one episode, played with the round limit `max_rounds`."""
        return EpisodeLoop(spec, self.env_client, seeded(self.generate, spec.sampling_seed), self.tokenizer,
                        self.config, max_rounds)

    def run(self, specs: Sequence[EpisodeSpec], max_rounds: int,
            on_result: Callable[[EpisodeResult], None] | None = None) -> RolloutOutput:
        """Run every spec (one EpisodeLoop each, each with the round limit `max_rounds`) and return the results in
        the order of `specs`."""
        started = time.monotonic()
        results: list[EpisodeResult | None] = [None] * len(specs)
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(len(specs), 1)),
                                thread_name_prefix="episode") as pool:
            futures = {pool.submit(self.episode_loop(spec, max_rounds).run): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()  # EpisodeLoop.run never raises
                if on_result is not None:
                    on_result(results[futures[future]])
        return RolloutOutput(results=results, metrics=summarize(results, time.monotonic() - started))
