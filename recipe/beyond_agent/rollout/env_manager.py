"""ParallelEnvManager: one Dataflow per episode in a thread pool, sharing one LLM front and one env client.

Why threads: an episode spends its time waiting, on the environment service (blocking HTTP) or on the
LLM server; threads let hundreds of episodes wait at once, so the LLM server always has work and no
episode waits for the slowest one (no lock-step turns). LLM calls go to the one event loop owned by the
LLM front (`AsyncLLMServerManager`); environment calls are plain blocking I/O in the episode's thread.

Infrastructure failures (`env_error`, `llm_error`, `timeout`) are not reward. `build_training_batch`
keeps them out of training by one of two policies, and the batch always keeps a shape verl accepts:
- `mask`: the row stays, but its response mask and reward are zeroed, so it adds nothing to the loss;
- `drop`: the row is removed; the batch is then cut to a multiple of `size_divisor` whole groups.
With a group-based estimator (GRPO, RLOO, ...) the failed episode's whole group goes with it, because
the group's baseline would otherwise be computed from the survivors only.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from recipe.beyond_agent.rollout.dataflow import Dataflow, DataflowConfig, EpisodeResult, EpisodeSpec, GenerateFn
from recipe.beyond_agent.rollout.handler import Episode, collate

FAILURE_POLICIES = ("mask", "drop")


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
        parser: the action parser of the environment (`recipe.beyond_agent.rollout.actions`).
        config: limits shared by all episodes; `max_rounds` may be overridden per call.
        max_workers: episodes in flight at once.
    """

    def __init__(self, env_client: Any, generate: GenerateFn, tokenizer: Any, parser: Any,
                 config: DataflowConfig, max_workers: int = 64):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.env_client = env_client
        self.generate = generate
        self.tokenizer = tokenizer
        self.parser = parser
        self.config = config
        self.max_workers = max_workers

    def dataflow(self, spec: EpisodeSpec, config: DataflowConfig | None = None) -> Dataflow:
        """The Dataflow for one episode."""
        return Dataflow(spec, self.env_client, self.generate, self.tokenizer, self.parser, config or self.config)

    def run(self, specs: Sequence[EpisodeSpec], max_rounds: int | None = None,
            on_result: Callable[[EpisodeResult], None] | None = None) -> RolloutOutput:
        """Run every spec (one Dataflow each) and return the results in the order of `specs`."""
        config = self.config if max_rounds is None else _with_rounds(self.config, max_rounds)
        started = time.monotonic()
        results: list[EpisodeResult | None] = [None] * len(specs)
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(len(specs), 1)),
                                thread_name_prefix="dataflow") as pool:
            futures = {pool.submit(self.dataflow(spec, config).run): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()  # Dataflow.run never raises
                if on_result is not None:
                    on_result(results[futures[future]])
        return RolloutOutput(results=results, metrics=summarize(results, time.monotonic() - started))


def _with_rounds(config: DataflowConfig, max_rounds: int) -> DataflowConfig:
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    return dataclasses.replace(config, max_rounds=max_rounds)


def excluded_rows(results: Sequence[EpisodeResult], group_based: bool) -> set[int]:
    """Rows to keep out of training: infra failures, and with a group estimator their whole group."""
    failed = {i for i, r in enumerate(results) if r.infra_failure}
    if not group_based:
        return failed
    failed_groups = {results[i].spec.group_id for i in failed}
    return {i for i, r in enumerate(results) if r.spec.group_id in failed_groups}


def build_training_batch(results: Sequence[EpisodeResult], pad_token_id: int, max_prompt_length: int,
                         max_response_length: int, policy: str = "mask", group_based: bool = True,
                         size_divisor: int = 1):
    """Collate results into verl's DataProto with infrastructure failures kept out of training.

    Returns (DataProto, kept_row_indices). See the module docstring for the two policies.
    """
    if policy not in FAILURE_POLICIES:
        raise ValueError(f"failure policy {policy!r} is not valid; choose one of {FAILURE_POLICIES}")
    excluded = excluded_rows(results, group_based)
    if policy == "drop":
        kept = _rows_after_drop(results, excluded, size_divisor)
        if kept:
            episodes = [_episode_or_placeholder(results[i], pad_token_id) for i in kept]
            return collate(episodes, pad_token_id, max_prompt_length, max_response_length), kept
    # mask (also the fallback when dropping would leave nothing)
    kept = list(range(len(results)))
    episodes = [_masked(_episode_or_placeholder(r, pad_token_id)) if i in excluded
                else _episode_or_placeholder(r, pad_token_id) for i, r in enumerate(results)]
    return collate(episodes, pad_token_id, max_prompt_length, max_response_length), kept


def _rows_after_drop(results: Sequence[EpisodeResult], excluded: set[int], size_divisor: int) -> list[int]:
    """Surviving rows, cut (whole groups last-first) to a multiple of size_divisor."""
    kept = [i for i in range(len(results)) if i not in excluded]
    while kept and len(kept) % size_divisor:
        last_group = results[kept[-1]].spec.group_id
        kept = [i for i in kept if results[i].spec.group_id != last_group] if last_group else kept[:-1]
    return kept


def _masked(episode: Episode) -> Episode:
    # Rule: a failed episode's tokens are not the policy's behaviour in a working world, so none of them
    # is trained on (mask 0) and it carries no reward.
    return Episode(prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                   response_mask=[0] * len(episode.response_ids),
                   response_logprobs=episode.response_logprobs, reward=0.0,
                   termination=episode.termination, num_turns=episode.num_turns,
                   prompt_truncated=episode.prompt_truncated)


def _episode_or_placeholder(result: EpisodeResult, pad_token_id: int) -> Episode:
    """The result's episode, or a one-token placeholder for one that failed before its prompt existed."""
    if result.episode is not None:
        return result.episode
    # Rule: a row must exist to keep the batch's shape; it holds one pad token and nothing to train on.
    return Episode(prompt_ids=[pad_token_id], response_ids=[pad_token_id], response_mask=[0],
                   response_logprobs=[0.0], reward=0.0, termination=result.termination)
