"""One episode, start to finish: env session -> (generate -> parse -> step -> observe)* -> evaluate -> release.

An EpisodeLoop runs in one thread of the ParallelEnvManager's pool. It does blocking environment I/O
itself and sends every LLM call to the shared LLM front (which owns the one event loop). It never
raises: whatever happens, it returns an `EpisodeResult` with exactly one termination reason, and its
environment session is released in `finally`.

The episode's `AgentTask` (on its `EpisodeSpec`, see `beyond_agent/tasks.py`) gives the first
messages, parses each reply into an action and turns the env's final score and per-step rewards into the
episode's reward. Each assistant turn gets one step reward: what the env returned for its action, 0.0
when the env did not step (the reply was not an action, or the turn hit the length limit).

**A limit cut is a forfeit** (issue #69). An episode a limit cuts (`LIMIT_CUTS`: the round limit, the response
length, the env's own step limit) has no result of its own, and a reply that is no action leaves the env where it
was: with step returns of 0, like a draw's, holding a state until the limit would beat losing from it. So the cut
episode's last turn is credited with the forfeit F (`Forfeit`: the env's declared `forfeit_reward`, else
`FORFEIT` in a game, whose answers name a seat, else 0.0, a cut scoring like failing), added to its step reward,
and the result carries F (`EpisodeResult.forfeit`) so that GiGPO counts it undiscounted at every turn of the
episode (beyond_agent/algorithms/gigpo.py). `SeatedEpisodeLoop` (seats.py) credits the seat a limit stopped by
the same rule (`EpisodeLoop._forfeit`).

Termination reasons (see `handler.TERMINATION_REASONS`):
- `done`       the environment said the task ended (terminated, success or failure);
- `max_rounds` the round limit of this training step;
- `truncated`  the environment's own step limit (its `truncated` flag): a limit of the env, not ours;
- `length`     the response reached max_response_length;
- `max_calls`  an agent behind the gateway made more calls than `gateway.max_calls` allows;
- `env_error`, `llm_error`, `timeout`: infrastructure failures (`timeout`: the episode's wall-clock budget,
  an LLM call's deadline, or an env call past the service's `--step-timeout`). They are never turned into reward:
  `EpisodeResult.infra_failure` tells the manager to keep them out of training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import requests

from envservice.envs.base import STATE_KEY
from envservice.envs.two_player import FORFEIT_REWARD, SEAT
from envservice.errors import EnvServiceError, EnvTimeoutError
from beyond_agent.rollout.handler import Episode, RolloutHandler
from beyond_agent.rollout.llm import request_seed
from beyond_agent.tasks import AgentTask, EnvTask, EpisodeOutcome
from beyond_agent.trajectory_data import INFRA_TERMINATIONS

logger = logging.getLogger(__name__)

INFRA_FAILURES = INFRA_TERMINATIONS
"""Terminations that are infrastructure failures, never reward (`agent_error`: a user's agent raised,
beyond_agent/gateway/agents.py); one list with the trajectory readers' (`trajectory_data`)."""


class GeneratedTurn(Protocol):
    """What a generate call returns: the sampled ids and their log-probs."""

    token_ids: list[int]
    logprobs: list[float] | None


FORFEIT = -1.0
"""A game's forfeit: the loss of a seat that did not finish it (TextArena's rule for a seat that does not move)."""
LIMIT_CUTS = ("max_rounds", "length", "max_calls", "truncated")
"""Terminations by a limit, not by the task's end: our round limit, the response length, the gateway's call limit
(rounds.CUT_BY_OUR_LIMITS), and the env's own step limit. Each is a forfeit (module docstring)."""


class Forfeit:
    """F, what a limit cut credits to an episode's last turn, as the env's answers tell it (module docstring).

    Why one rule for every env: a cut must never score above losing, or holding a state until the limit pays.
    A game's loss is `FORFEIT`; an env may declare its own F in its answers' info (`FORFEIT_REWARD`); an env
    with neither has no loss value, so a cut credits 0.0 and scores like failing."""

    def __init__(self) -> None:
        self.declared: float | None = None
        """The env's own F (its answers' `info[FORFEIT_REWARD]`), once one said it."""
        self.seated = False
        """Whether an answer named a seat (`info[SEAT]`): the env is a game."""

    def note(self, info: Mapping[str, Any] | None) -> None:
        """Learn from one create or step answer's info; a declared forfeit that is not a number is the env's error."""
        info = info or {}
        declared = info.get(FORFEIT_REWARD)
        if declared is not None:
            if isinstance(declared, bool) or not isinstance(declared, (int, float)):
                raise _EpisodeFailure("env_error", f"the env's info[{FORFEIT_REWARD!r}] must be a number; "
                                      f"got {declared!r}")
            self.declared = float(declared)
        self.seated = self.seated or info.get(SEAT) is not None

    @property
    def value(self) -> float:
        """F: the declared value, else `FORFEIT` in a game, else 0.0."""
        if self.declared is not None:
            return self.declared
        return FORFEIT if self.seated else 0.0

    def credit(self, step_rewards: list[float]) -> float | None:
        """Add F to the last turn's step reward of an episode a limit cut (in place); the F credited, or None when
        the episode has no turn to credit.

        Rule: added, not replacing: the turn keeps what the env paid for its action, and the episode's step rewards
        sum to its real rewards plus F (a summed task reward, `StepRewardTask`, sees the forfeit once)."""
        if not step_rewards:
            return None
        step_rewards[-1] += self.value
        return self.value


GenerateFn = Callable[..., GeneratedTurn]
"""generate(request_id, prompt_ids, max_tokens) -> GeneratedTurn; raises on an LLM failure. Episodes with a
`sampling_seed` call it with a keyword `seed=` as well (`seeded`): the request's sampling seed."""


def seeded(generate: GenerateFn, episode_seed: int | None) -> GenerateFn:
    """`generate` with each call's sampling seed set: call k of the episode samples with
    `request_seed(episode_seed, k)`, so an episode played again with the same seed samples the same turns (on the
    same weights, up to the server's own arithmetic). `generate` itself when `episode_seed` is None."""
    if episode_seed is None:
        return generate
    calls = itertools.count()  # an episode's calls come one after another: their order is the turn order

    def generate_seeded(request_id: str, prompt_ids: list[int], max_tokens: int) -> GeneratedTurn:
        return generate(request_id, prompt_ids, max_tokens, seed=request_seed(episode_seed, next(calls)))

    return generate_seeded


@dataclass
class EpisodeSpec:
    """One episode to run: which environment and task, and where it sits in the batch."""

    env_id: str
    """Registered envservice id, e.g. "babyai"."""
    task_id: int | str | None = None
    """Task index or name within the split; None lets the environment choose from the seed."""
    seed: int | None = None
    """Seed for the task's randomness; None lets the service draw one."""
    split: str = "train"
    """Task split, e.g. "train" or "test"."""
    params: dict[str, Any] = field(default_factory=dict)
    """Environment-specific task parameters."""
    group_id: str = ""
    """Episodes with the same group_id sample the same task (verl's `uid`): one GRPO group."""
    index: int = 0
    """Row of this episode in the batch."""
    agent_task: AgentTask = field(default_factory=EnvTask)
    """How this episode is prompted, parsed and scored (the row's task; see beyond_agent/tasks.py)."""
    prompt: list[dict] | None = None
    """The dataset row's prompt messages, if it has any (`AgentTask.first_messages` uses them)."""
    sampling_seed: int | None = None
    """The seed its turns' sampling seeds derive from (`seeded`): the run's seed and the episode's place in it
    (`place_seeds`); None lets the LLM server draw them."""
    seat: int | None = None
    """In a game with several seats (`beyond_agent/rollout/seats.py`), the seat this episode played; None in a
    one-player episode."""
    opponent: str | None = None
    """In such a game, who played the other seats: `self` (the policy) or a scripted opponent's name."""


def place_seeds(specs: Sequence[EpisodeSpec], run_seed: int | None, *place: object) -> list[EpisodeSpec]:
    """The specs with their sampling seeds, from the run's seed, `place` (e.g. which step, which row) and each
    spec's index (its row in the batch, or its sample in the row's group): the same in every run of one config.
    The specs unchanged when `run_seed` is None."""
    if run_seed is None:
        return list(specs)
    return [dataclasses.replace(spec, sampling_seed=request_seed(run_seed, *place, spec.index)) for spec in specs]


@dataclass(frozen=True)
class EpisodeConfig:
    """The limits every episode of a run shares (validated here; the recipe's settings hold one). The round limit
    is not among them: it may change from one training step to the next (`RoundLimit`), so each episode is given
    its own (`EpisodeLoop(..., max_rounds)`)."""

    max_prompt_length: int
    """Tokens of the first prompt (system + first observation)."""
    max_response_length: int
    """Tokens of everything after the prompt: assistant turns and observations."""
    max_tokens_per_turn: int
    """New tokens per assistant turn at most (AgentGym-RL's rollout.max_tokens)."""
    episode_timeout_s: float = 600.0
    """Wall-clock budget of one episode; past it the episode ends with `timeout`."""

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_response_length", "max_tokens_per_turn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EpisodeConfig.{name} must be an int >= 1; got {value!r}")
        if not self.episode_timeout_s > 0:
            raise ValueError(f"EpisodeConfig.episode_timeout_s must be > 0; got {self.episode_timeout_s!r}")


def check_max_rounds(value: Any) -> int:
    """An episode's round limit, refused unless an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"max_rounds must be an int >= 1; got {value!r}")
    return value


@dataclass
class EpisodeResult:
    """A finished episode: its tokens, outcome and timings."""

    spec: EpisodeSpec
    episode: Episode | None
    """Token lists for training; None when the episode failed before its first prompt existed."""
    termination: str
    reward: float = 0.0
    """The task's reward (`AgentTask.reward`); 0.0 for an infrastructure failure."""
    success: bool = False
    score: float = 0.0
    """The env's final `evaluate()` score (0.0 when the episode never got that far)."""
    step_rewards: list[float] = field(default_factory=list)
    """One per assistant turn: the env's reward for that turn's action (0.0 where it did not step); the last turn of
    an episode a limit cut also carries the forfeit (`forfeit`)."""
    forfeit: float | None = None
    """The forfeit F added to the last turn's step reward when a limit cut this episode (a seat's: the seat the
    limit stopped; the seats that won the walkover have none); None otherwise. GiGPO counts it undiscounted at
    every turn of the episode, so that from any state, holding it until the limit (a game's -1) is never worth
    more than losing from it (-gamma^k >= -1)."""
    anchors: list[str] = field(default_factory=list)
    """One per assistant turn: the env state the turn started from (`state_anchor`), GiGPO's anchor states."""
    refused_turns: int = 0
    """Assistant turns whose reply the task could not read as an action, or that the env refused (its step's
    `info["invalid"]`): the invalid or illegal moves."""
    rounds: int = 0
    messages: list[dict] = field(default_factory=list)
    error: str | None = None
    """What went wrong, for env_error / llm_error / timeout."""
    env_time_s: float = 0.0
    llm_time_s: float = 0.0
    wall_time_s: float = 0.0
    agent_mode: str | None = None
    """For an episode played by a user's agent behind the gateway: "merged" (its calls formed one sample) or
    "per_call" (it rewrote its history); None for our own loop."""
    later_step_rewards: list[float] = field(default_factory=list)
    """For a segment of a per_call agent episode: the step rewards of the episode's turns after this segment's
    (its later segments'), so that a turn's step return runs to the episode's end (GiGPO); empty otherwise."""
    earlier_segments: list["EpisodeResult"] = field(default_factory=list)
    """For a per_call agent episode: the samples its calls formed before the last one (this result's `episode`),
    each with its own tokens, step rewards and anchors and this episode's reward, termination and success. They
    train as rows of their own, beside this episode's row (`rollout.batch.segment_batch`)."""
    other_seats: list["EpisodeResult"] = field(default_factory=list)
    """For a game whose every seat the policy played (`beyond_agent/rollout/seats.py`, self-play): the episodes of
    the seats after this result's, each with its own tokens, reward and `spec.seat`. They train as rows of their
    own, in their seat's group (`rollout.batch.segment_batch`)."""

    @property
    def infra_failure(self) -> bool:
        """True when the episode ended for an infrastructure reason (not to be trained on)."""
        return self.termination in INFRA_FAILURES

    def to_record(self, step: int = 0, kind: str = "train", policy_version: int | None = None) -> dict[str, Any]:
        """One JSON-serialisable line in the trajectory schema (`beyond_agent/trajectories.py`)."""
        from beyond_agent.trajectories import episode_record

        return episode_record(self, step, kind, policy_version).to_json()


class _EpisodeFailure(Exception):
    """Ends an episode with an infrastructure termination reason."""

    def __init__(self, termination: str, message: str):
        super().__init__(message)
        self.termination = termination


class EpisodeLoop:
    """Runs one episode against an envservice client and a generate function; see the module docstring."""

    def __init__(self, spec: EpisodeSpec, env_client: Any, generate: GenerateFn, tokenizer: Any,
                 config: EpisodeConfig, max_rounds: int):
        self.spec = spec
        self.task = spec.agent_task
        self.env = env_client
        self.generate = generate
        self.tokenizer = tokenizer
        self.config = config
        self.max_rounds = check_max_rounds(max_rounds)
        """Assistant turns at most: the round limit of the step this episode is played for."""
        self.request_id = f"{spec.group_id or 'episode'}-{spec.index}-{uuid.uuid4().hex[:8]}"
        self._deadline = 0.0
        self._env_time = 0.0
        self._llm_time = 0.0
        self._rounds = 0
        self._step_rewards: list[float] = []
        self._anchors: list[str] = []  # one per turn, beside _step_rewards
        self._state = ""  # the env state the next turn starts from (`state_anchor`)
        self._refused = 0  # turns whose reply was no action, or an action the env refused
        self.forfeit = Forfeit()
        """F, learnt from this episode's env answers (a game's seats share their game's: seats.py)."""
        self._forfeited: float | None = None  # the F credited to the last turn, once a limit cut the episode

    def run(self) -> EpisodeResult:
        """Play the episode; always returns a result and always releases the session."""
        started = time.monotonic()
        self._deadline = started + self.config.episode_timeout_s
        session_id, handler = None, None
        try:
            session_id, first_observation = self._create_session()
            handler = self._new_handler(first_observation)
            self._play(handler, session_id)
            if handler.termination in LIMIT_CUTS:
                self._forfeit()
            score, success = self._evaluate(session_id)
            result = self._scored_result(handler, score, success)
        except _EpisodeFailure as failure:
            result = self._result(handler, failure.termination, error=str(failure))
        finally:
            self._release(session_id)
        result.wall_time_s = time.monotonic() - started
        return result

    # ---- the loop --------------------------------------------------------------------------------

    def _play(self, handler: RolloutHandler, session_id: str) -> None:
        """Generate, act and observe until a termination reason is set on the handler."""
        for round_number in range(1, self.max_rounds + 1):
            if handler.remaining_response_length <= 0:
                # The last observation filled the response exactly: no room for a turn, and a request
                # for 0 new tokens would be refused by the server, so this is `length`, not an LLM error.
                handler.finish("length")
                return
            self._rounds = round_number
            turn = self._generate(handler)
            handler.add_generated(turn)
            self._anchors.append(self._state)
            if handler.done:  # the response hit max_response_length: `length`, and the env does not step
                self._step_rewards.append(0.0)
                return
            observation, ended = self._act(session_id, turn.token_ids)
            if ended:
                handler.finish(ended)
                return
            if round_number == self.max_rounds:
                handler.finish("max_rounds")
                return
            handler.add_observation(observation)
            if handler.done:
                return

    def _act(self, session_id: str, token_ids: list[int]) -> tuple[str, str | None]:
        """Parse the reply and step the env; records the turn's step reward; returns (observation, termination
        or None)."""
        # Decoding here only feeds the action parser; training keeps the sampled ids.
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        parsed = self.task.parse(text)
        if parsed.action is None:
            self._step_rewards.append(0.0)  # no action, no env step
            self._refused += 1
            return parsed.error, None  # the model sees why its reply was not an action
        step = self._env_call(self.env.step, session_id, parsed.action)
        self._step_rewards.append(float(step.reward))
        info = getattr(step, "info", None) or {}
        self.forfeit.note(info)
        self._refused += bool(info.get("invalid"))
        self._state = state_anchor(step.observation, info)  # no action: unchanged
        if step.terminated:
            return step.observation, "done"
        if step.truncated:
            return step.observation, "truncated"
        return step.observation, None

    def _forfeit(self) -> None:
        """A limit cut this episode: its last turn is credited with the forfeit (`Forfeit.credit`), and the result
        carries it. The one-player loop and a game's seat (seats.py) both forfeit through here."""
        self._forfeited = self.forfeit.credit(self._step_rewards)

    # ---- calls with their failure mapping --------------------------------------------------------

    def _generate(self, handler: RolloutHandler) -> GeneratedTurn:
        self._check_deadline()
        max_tokens = min(self.config.max_tokens_per_turn, handler.remaining_response_length)
        started = time.monotonic()
        try:
            return self.generate(self.request_id, handler.prompt_ids_for_next_turn(), max_tokens)
        except Exception as exc:  # any failure of the LLM front ends this episode only
            # LLMError says whether it was a timeout; anything else from the front is an llm_error.
            raise _EpisodeFailure(getattr(exc, "termination", "llm_error"), f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._llm_time += time.monotonic() - started

    def _env_call(self, method: Callable, *args: Any) -> Any:
        self._check_deadline()
        started = time.monotonic()
        try:
            return method(*args)
        except (EnvTimeoutError, requests.Timeout) as exc:
            # The service's per-call limit (env_timeout) or our own request deadline: the env hung, not the model.
            raise _EpisodeFailure("timeout", f"{type(exc).__name__}: {exc}") from exc
        except (EnvServiceError, requests.RequestException, ValueError) as exc:
            raise _EpisodeFailure("env_error", f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._env_time += time.monotonic() - started

    def _check_deadline(self) -> None:
        if time.monotonic() > self._deadline:
            raise _EpisodeFailure("timeout", f"episode exceeded {self.config.episode_timeout_s:.0f} s")

    def _create_session(self) -> tuple[str, str]:
        s = self.spec
        created = self._env_call(self.env.create, s.env_id, s.task_id, s.seed, s.split, s.params)
        self._state = state_anchor(created.observation, getattr(created, "info", None))
        self.forfeit.note(getattr(created, "info", None))
        return created.session_id, created.observation

    def _new_handler(self, first_observation: str) -> RolloutHandler:
        try:
            messages = self.task.first_messages(first_observation, self.spec.prompt)
            return RolloutHandler(self.tokenizer, messages, self.config.max_prompt_length,
                                  self.config.max_response_length)
        except ValueError as exc:  # a malformed row prompt is bad data for this episode, not a crash of the step
            raise _EpisodeFailure("env_error", f"the first messages cannot start an episode: {exc}") from exc

    def _evaluate(self, session_id: str) -> tuple[float, bool]:
        evaluation = self._env_call(self.env.evaluate, session_id)
        return evaluation.score, evaluation.success

    def _release(self, session_id: str | None) -> None:
        """Release the session; a failure here is logged (the service's reaper frees it eventually)."""
        if session_id is None:
            return
        try:
            self.env.release(session_id)
        except (EnvServiceError, requests.RequestException) as exc:
            logger.warning("could not release session %s: %s", session_id, exc)

    def _scored_result(self, handler: RolloutHandler, score: float, success: bool) -> EpisodeResult:
        """The result of an episode that ended normally, with its reward from the task."""
        outcome = EpisodeOutcome(score=score, success=success, step_rewards=tuple(self._step_rewards),
                                 termination=handler.termination, rounds=self._rounds)
        try:
            reward = float(self.task.reward(outcome))
        except Exception as exc:  # a bug in a user's task ends this episode only, and is not reward
            raise _EpisodeFailure("env_error", f"{self.task.label}.reward raised {type(exc).__name__}: {exc}") \
                from exc
        return self._result(handler, handler.termination, reward=reward, success=success, score=score)

    def _result(self, handler: RolloutHandler | None, termination: str, reward: float = 0.0,
                success: bool = False, score: float = 0.0, error: str | None = None) -> EpisodeResult:
        episode = None
        if handler is not None:
            if handler.termination is None:
                handler.finish(termination)
            handler.reward = reward
            handler.step_rewards = list(self._step_rewards)
            episode = handler.to_episode()
            episode.termination = termination  # an infra failure after a length stop is still a failure
        return EpisodeResult(
            spec=self.spec, episode=episode, termination=termination, reward=reward, success=success, score=score,
            step_rewards=list(self._step_rewards), forfeit=self._forfeited, anchors=list(self._anchors),
            refused_turns=self._refused, rounds=self._rounds,
            messages=list(handler.messages) if handler else [], error=error,
            env_time_s=self._env_time, llm_time_s=self._llm_time,
        )


TEXT_ANCHOR_PREFIX = "text:"
"""How an anchor made from the observation text starts (one from the env's state key starts with "key:")."""


def state_anchor(observation: str, info: Mapping[str, Any] | None) -> str:
    """A short stable key of an env state: its `info[STATE_KEY]` when the env gives one ("key:<digest>"), else its
    observation ("text:<digest>", which also holds the feedback on the last action: GiGPO counts these turns)."""
    key = (info or {}).get(STATE_KEY)
    if key is not None:
        return "key:" + hashlib.sha1(f"{key}".encode()).hexdigest()[:16]
    return TEXT_ANCHOR_PREFIX + hashlib.sha1(observation.encode()).hexdigest()[:16]


def run_episode_loops(specs: Sequence[EpisodeSpec],
                      make_loop: Callable[[EpisodeSpec], EpisodeLoop]) -> list[EpisodeResult]:
    """Run episode loops one after another (the naive baseline the benchmark compares against)."""
    return [make_loop(spec).run() for spec in specs]
