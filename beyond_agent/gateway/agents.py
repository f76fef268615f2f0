"""Agents as rollout workers: per episode the trainer runs a user's agent against the gateway and an env.

The agent is any Python callable (`beyond_agent.agent.function: "package.module:function"`), sync or async,
taking one `AgentContext`: an OpenAI base URL that is this episode's, the model name, and the episode's env
session (`AgentContext.env`: the current observation, `step(action)`). Or it is a command
(`beyond_agent.agent.command`), run once per episode (`CommandAgent`) in the sandbox (`beyond_agent.agent.sandbox`)
with the episode's OpenAI base URL, key, model and env URL in its environment; its env steps go through the gateway's `/env` routes to the same session
(a Python command rebuilds its `AgentContext` with `gateway.remote.episode_context()`). It talks to the policy
only through the OpenAI API (any SDK or framework) and acts only through `env.step`. When it returns, the env scores the
episode (`/evaluate`) and the episode's `AgentTask` turns that into the reward, as in our own loop.

What trains: the gateway's record of the episode (`GatewayEpisode`). When the agent only appended to its
history, that is one multi-turn sample with our exact ids and masks. When it rewrote its history, its calls
formed several samples (segments): the last one is the episode's own row, the earlier ones
(`EpisodeResult.earlier_segments`) train as rows of their own beside it, each with the episode's reward and the
step rewards of its own calls (`rollout.batch.segment_batch`; the trainer adds them to verl's batch).

Failures: an agent that raises ends its episode with `agent_error`, an infrastructure failure like an env or
LLM error: never reward, kept out of training. An LLM failure inside a call is `llm_error`; an env call that
fails (or one past the episode's wall-clock budget) is `env_error` / `timeout` even when the agent catches it.

Per assistant turn (= gateway call of a segment) the step reward is the sum of the rewards of the env
steps the agent took after that call and before the next one, and the anchor is the env state the call
started from (GiGPO's grouping).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import json
import os
import secrets
import shlex
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import requests

from envservice.errors import EnvServiceError, EnvTimeoutError
from envservice.registry import import_object
from sandbox import SandboxConfig, run_sandboxed, sandbox_path
from beyond_agent.sections import from_section
from beyond_agent.gateway.episodes import GatewayEpisode
from beyond_agent.gateway.server import Gateway, GatewayConfig, check_episode_limits
from beyond_agent.rollout.episode_loop import (INFRA_FAILURES, LIMIT_CUTS, EpisodeConfig, EpisodeResult, EpisodeSpec,
                                           Forfeit, GenerateFn, _EpisodeFailure, check_max_rounds, seeded,
                                           state_anchor)
from beyond_agent.rollout.env_manager import ParallelEnvManager
from beyond_agent.tasks import EpisodeOutcome

AGENT_ERROR = "agent_error"
"""Termination of an episode whose agent raised (an infrastructure failure, never reward)."""


@dataclass(frozen=True)
class AgentConfig:
    """`beyond_agent.agent`: play episodes with a user's agent behind the gateway instead of our own loop."""

    function: str | None = None
    """"package.module:function" or "path/to/file.py:function" (relative to the working directory) of the agent
    (sync or async, taking an `AgentContext`); None: our own loop."""
    command: str | None = None
    """Instead of `function`: a command line (split like a shell's, no shell) run once per episode; it talks
    to the policy and the env over HTTP (`CommandAgent`). Exit status 0: the episode is scored; otherwise, or
    past `beyond_agent.episode_timeout_s`, it is an infrastructure failure."""
    merge: str = GatewayConfig.merge
    """`auto`: an agent that appends to its history gives one multi-turn sample; `never`: one per call (the
    gateway's `GatewayConfig.merge`, whose default this is)."""
    max_calls: int = GatewayConfig.max_calls
    """Chat-completions calls (and so training samples) one episode may make; past it the episode ends as
    `max_calls` (the gateway's `GatewayConfig.max_calls`, whose default this is)."""
    sandbox: Any = None
    """`SandboxConfig` (a mapping in YAML) of the sandbox a `command` runs in; None: its defaults (bubblewrap).
    Nothing of the trainer's environment reaches the command but what `sandbox.pass_env` names."""

    def __post_init__(self) -> None:
        if not isinstance(self.sandbox, SandboxConfig):
            if self.sandbox is not None and not isinstance(self.sandbox, Mapping):
                raise ValueError(f"beyond_agent.agent.sandbox must be a mapping, got {self.sandbox!r}")
            object.__setattr__(self, "sandbox", from_section(SandboxConfig, self.sandbox,
                                                             "beyond_agent.agent.sandbox"))
        if self.function is not None and self.command is not None:
            raise ValueError("beyond_agent.agent: set function or command, not both")
        if self.command is not None and (not isinstance(self.command, str) or not shlex.split(self.command)):
            raise ValueError(f"beyond_agent.agent.command must be a non-empty command line, got {self.command!r}")
        if self.function is not None and (not isinstance(self.function, str) or self.function.count(":") != 1):
            raise ValueError(f"beyond_agent.agent.function must be 'package.module:function' or "
                             f"'path/to/file.py:function', got {self.function!r}")
        check_episode_limits("beyond_agent.agent", self.merge, self.max_calls)

    @property
    def active(self) -> bool:
        """Whether episodes are played by the user's agent."""
        return self.function is not None or self.command is not None

    def load(self, timeout_s: float) -> Callable[["AgentContext"], Any]:
        """The agent to run per episode: the imported function, or a `CommandAgent` (its program checked to
        exist) stopped past `timeout_s`. ValueError naming the key when either cannot be found."""
        if self.function is not None:
            return load_agent(self.function)
        program = shlex.split(self.command)[0]
        if shutil.which(program, path=sandbox_path()) is None:
            raise ValueError(f"beyond_agent.agent.command={self.command!r}: no program {program!r} on PATH "
                             "or at that path")
        return CommandAgent(self.command, timeout_s, self.sandbox)


def load_agent(path: str) -> Callable[["AgentContext"], Any]:
    """The callable named by "package.module:function" or "file.py:function", or a ValueError saying what
    could not be found."""
    module_name, _, name = path.partition(":")
    try:
        agent = (getattr(_module_from_file(Path(module_name)), name, None) if module_name.endswith(".py")
                 else import_object(path))
    except (ImportError, FileNotFoundError) as error:
        raise ValueError(f"beyond_agent.agent.function={path!r}: cannot import {module_name!r} ({error})") from error
    except AttributeError:
        agent = None
    if not callable(agent):
        raise ValueError(f"beyond_agent.agent.function={path!r}: {module_name} has no callable {name!r}")
    return agent


def _module_from_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no file {path.resolve()}")
    spec = importlib.util.spec_from_file_location(f"beyond_agent_user_agent_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class EnvStep:
    """What the env answered to one action."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class ConcurrentStep(RuntimeError):
    """A step sent while another step of the same episode was under way (the agent's error)."""


class EnvSession:
    """The episode's environment as the agent sees it: `observation` (the latest) and `step(action)`."""

    def __init__(self, client: Any, session_id: str, observation: str, info: dict[str, Any] | None,
                 max_steps: int, calls_so_far: Callable[[], int], deadline: float = float("inf")) -> None:
        self.observation = observation
        """The env's latest observation (the first one before any step)."""
        self.max_steps = max_steps
        """Env steps this episode may take (the step's round limit); `step` refuses more."""
        self.done = False
        """True once the env ended the episode or the step limit was reached."""
        self.ended_by_env = False
        """True when the env itself ended it (terminated), not a limit."""
        self.truncated_by_env = False
        """True when the env's own step limit ended it (truncated)."""
        self.session_id = session_id
        self.env_time_s = 0.0
        """Seconds spent in env calls."""
        self.failure: tuple[str, str] | None = None
        """(termination, message) when an env call failed for an infrastructure reason (env_error, timeout): the
        episode ends with it even if the agent caught the exception."""
        self._client, self._calls_so_far, self._deadline = client, calls_so_far, deadline
        self._first_state = state_anchor(observation, info)
        self.forfeit = Forfeit()
        """What a limit cut credits this episode's last turn, as the env's answers tell it (`Forfeit`)."""
        self.forfeited: tuple[int, float] | None = None
        """(the call credited, F) once a limit cut the episode (`credit_forfeit`)."""
        self._note(info, in_step=False)
        self._steps: list[tuple[int, float, str]] = []  # (gateway calls answered before it, reward, state after)
        self._stepping = threading.Lock()

    def step(self, action: str) -> EnvStep:
        """Apply one action. Raises RuntimeError once the episode is over (the agent should stop), and
        `ConcurrentStep` when another step of this episode is under way (the agent's error, never the env's)."""
        # One step at a time, the limit checked under the same lock: concurrent steps can neither pass the step
        # limit nor reach the env as a `busy` session that would be counted as an env failure.
        if not self._stepping.acquire(blocking=False):
            raise ConcurrentStep("another step of this episode is under way: an episode's steps are taken one at "
                                 "a time")
        try:
            return self._step(action)
        finally:
            self._stepping.release()

    def _step(self, action: str) -> EnvStep:
        if self.done:
            raise RuntimeError("the episode is over: stop acting and return")
        started = time.monotonic()
        if started > self._deadline:
            self._failed("timeout", "the episode ran past its wall-clock budget (episode_timeout_s)")
        try:
            answer = self._client.step(self.session_id, action)
        except (EnvTimeoutError, requests.Timeout) as exc:
            self._failed("timeout", f"{type(exc).__name__}: {exc}")
        except (EnvServiceError, requests.RequestException) as exc:
            self._failed("env_error", f"{type(exc).__name__}: {exc}")
        finally:
            self.env_time_s += time.monotonic() - started
        step = EnvStep(answer.observation, float(answer.reward), bool(answer.terminated), bool(answer.truncated),
                       dict(getattr(answer, "info", None) or {}))
        self._note(step.info)
        self._steps.append((self._calls_so_far(), step.reward, state_anchor(step.observation, step.info)))
        self.observation = step.observation
        self.ended_by_env = step.terminated
        self.truncated_by_env = step.truncated and not step.terminated
        self.done = step.done or len(self._steps) >= self.max_steps
        return step

    def _note(self, info: dict[str, Any] | None, in_step: bool = True) -> None:
        """Learn the forfeit from an answer; a declaration that is not a number is the env's error (it ends the
        episode; raised to the agent only from a step, never from the session's making)."""
        try:
            self.forfeit.note(info)
        except _EpisodeFailure as failure:
            if in_step:
                self._failed(failure.termination, str(failure))
            self.failure, self.done = (failure.termination, str(failure)), True

    def credit_forfeit(self, calls: int) -> float | None:
        """A limit cut the episode after `calls` gateway calls: its last call's turn is credited with the forfeit,
        the same rule as our own loop's (`Forfeit.credit`); F, or None when there is no call to credit."""
        if calls < 1:
            return None
        self.forfeited = (calls - 1, self.forfeit.value)
        return self.forfeit.value

    def _failed(self, termination: str, message: str) -> None:
        """Record an infrastructure failure and end the episode: the agent sees it raised and should return."""
        self.failure, self.done = (termination, message), True
        raise RuntimeError(f"the environment failed ({termination}): {message}")

    def turn_rewards_and_anchors(self, first_call: int, calls: int) -> tuple[list[float], list[str]]:
        """Step rewards and anchors of calls `first_call`..`calls - 1`: a call's step reward is the sum of the
        rewards of the env steps after it and before the next call; its anchor is the env state it started from."""
        rewards, anchors = [0.0] * (calls - first_call), []
        for call in range(first_call, calls):
            before = [state for calls_before, _, state in self._steps if calls_before <= call]
            anchors.append(before[-1] if before else self._first_state)
        for calls_before, reward, _ in self._steps:
            if first_call < calls_before <= calls:
                rewards[calls_before - first_call - 1] += reward
        if self.forfeited is not None and first_call <= self.forfeited[0] < calls:
            rewards[self.forfeited[0] - first_call] += self.forfeited[1]  # the cut's forfeit, on the last turn
        return rewards, anchors

    @property
    def termination(self) -> str:
        """How the episode ended if nothing failed: `done` (the env ended it, or the agent stopped), `truncated`
        (the env's own step limit) or `max_rounds` (the step's round limit)."""
        if self.ended_by_env or not self.done:
            return "done"
        return "truncated" if self.truncated_by_env else "max_rounds"


SANDBOX_GATEWAY_PORT = 8080
"""The port a sandboxed command reaches its gateway on (inside the sandbox, 127.0.0.1 is its own)."""


class CommandAgent:
    """A command run once per episode as the agent (`beyond_agent.agent.command`), looked up on `sandbox_path()`,
    in the sandbox (`sandbox`: no network but its gateway, the host read-only, limits, nothing left running after it), with the working
    directory of the trainer (read-only), `python` the trainer's interpreter, and an environment holding only the
    sandbox's allowlist, what `sandbox.pass_env` / `sandbox.env` give on purpose, and:

    - `OPENAI_BASE_URL`: the episode's OpenAI base URL (the `openai` SDK reads it by itself), `OPENAI_API_KEY`:
      the episode's key (the gateway answers only requests that carry it), `BEYOND_AGENT_MODEL`: the model name;
    - `BEYOND_AGENT_ENV_URL`: the episode's env (`GET` it for observation, done, max_steps; `POST {"action"}` to
      its `/step`; both with the key), `BEYOND_AGENT_EPISODE`: JSON of env_id, task_id, seed, split, group_id,
      index.

    It returns normally when the command exits with 0; otherwise it raises (the episode ends as `agent_error`,
    with the end of the command's stderr), and past `timeout_s` the sandbox is killed with everything in it
    (`AgentTimeout`). Its output is kept as head and tail only (`sandbox.output_kb`); stdout is not used."""

    def __init__(self, command: str, timeout_s: float, sandbox: SandboxConfig | None = None) -> None:
        self.command, self.timeout_s, self.sandbox = command, timeout_s, sandbox or SandboxConfig()

    def __call__(self, ctx: "AgentContext") -> None:
        base_url, env_url, forward = ctx.base_url, ctx.env_url, None
        if self.sandbox.contained:  # the sandbox reaches the gateway only through its socket, on its own loopback
            if not ctx.gateway_socket:
                raise RuntimeError("a sandboxed command agent needs the gateway's Unix socket (AgentContext.gateway_socket)")
            base_url, env_url = _on_port(base_url, SANDBOX_GATEWAY_PORT), _on_port(env_url, SANDBOX_GATEWAY_PORT)
            forward = {SANDBOX_GATEWAY_PORT: ctx.gateway_socket}
        environment = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": ctx.api_key, "BEYOND_AGENT_MODEL": ctx.model,
                       "BEYOND_AGENT_ENV_URL": env_url,
                       "BEYOND_AGENT_EPISODE": json.dumps(
                           {"env_id": ctx.spec.env_id, "task_id": ctx.spec.task_id, "seed": ctx.spec.seed,
                            "split": ctx.spec.split, "group_id": ctx.spec.group_id, "index": ctx.spec.index})}
        done = run_sandboxed(shlex.split(self.command), self.sandbox, wall_s=self.timeout_s, environment=environment,
                             forward=forward, cwd=os.getcwd())
        if done.ended == "wall_clock":
            raise AgentTimeout(f"the command {self.command!r} ran past {self.timeout_s:g} s and was killed, with "
                               "everything it started")
        if done.returncode != 0:
            raise RuntimeError(f"the command {self.command!r} exited with {done.returncode}: "
                               f"{done.stderr.text().strip()[-600:] or '(no stderr)'}")


def _on_port(url: str, port: int) -> str:
    """`url` (http://host:port/path) with its host and port replaced by 127.0.0.1:`port`."""
    scheme, _, rest = url.partition("://")
    path = rest.partition("/")[2]
    return f"{scheme}://127.0.0.1:{port}/{path}"


class AgentTimeout(Exception):
    """The agent ran past the episode's wall-clock budget (the episode ends as `timeout`)."""


@dataclass
class AgentContext:
    """What a user's agent gets for one episode."""

    base_url: str
    """The OpenAI base URL of this episode, e.g. `openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key)`."""
    api_key: str
    """The episode's key: the gateway answers this episode's requests only with it (OpenAI SDKs send it)."""
    model: str
    """The model name to send."""
    env: EnvSession
    """The episode's env: `env.observation`, `env.step(action)`, `env.done`."""
    spec: EpisodeSpec
    """Which env, task and seed this episode plays."""
    env_url: str = ""
    """The same env over HTTP (the gateway's `/env` routes), for an agent in another process."""
    gateway_socket: str | None = None
    """The gateway's Unix socket (how a sandboxed command agent reaches it)."""


class AgentEpisodeLoop:
    """One episode played by a user's agent (module docstring); `run()` never raises, like `EpisodeLoop.run`."""

    def __init__(self, spec: EpisodeSpec, env_client: Any, gateway: Gateway, gateway_url: str,
                 agent: Callable[[AgentContext], Any], config: EpisodeConfig, max_rounds: int,
                 generate: GenerateFn | None = None, gateway_socket: str | None = None) -> None:
        self.spec, self.env, self.gateway, self.gateway_url = spec, env_client, gateway, gateway_url
        self.agent, self.config, self.generate, self.gateway_socket = agent, config, generate, gateway_socket
        self.max_rounds = check_max_rounds(max_rounds)
        self.episode_id = f"{spec.group_id or 'episode'}-{spec.index}-{uuid.uuid4().hex[:8]}"

    def run(self) -> EpisodeResult:
        """Create the env session, run the agent, score, release; always returns a result."""
        started = time.monotonic()
        key = secrets.token_urlsafe(24)  # the episode's own: its agent's requests carry it, no other agent has it
        self.gateway.open_episode(self.episode_id, self.generate, key=key)
        session, termination, error, score, success = None, None, None, 0.0, False
        try:
            s = self.spec
            created = self.env.create(s.env_id, s.task_id, s.seed, s.split, s.params)
            session = EnvSession(self.env, created.session_id, created.observation, getattr(created, "info", None),
                                 self.max_rounds, lambda: self.gateway.calls_answered(self.episode_id),
                                 deadline=started + self.config.episode_timeout_s)
            self.gateway.attach_env(self.episode_id, session)
            episode_url = f"{self.gateway_url}/episodes/{self.episode_id}"
            context = AgentContext(f"{episode_url}/v1", key, self.gateway.config.model_name, session, s,
                                   env_url=f"{episode_url}/env", gateway_socket=self.gateway_socket)
            try:
                self._call_agent(context)
            except AgentTimeout as exc:  # the agent ran past the episode's budget: not reward
                termination, error = "timeout", str(exc)
            except Exception as exc:  # the agent's own failure: not reward
                termination, error = AGENT_ERROR, f"the agent raised {type(exc).__name__}: {exc}"
            if termination == AGENT_ERROR and self.gateway.limit_reached(self.episode_id):
                termination, error = None, None  # cut off by a limit (calls, length): it ended it (scored), no fault
            if session.failure is not None:  # the env failed under the agent: that, not the agent, ended it
                termination, error = session.failure
            if termination is None:
                evaluation = self.env.evaluate(created.session_id)
                score, success = float(evaluation.score), bool(evaluation.success)
        except (EnvTimeoutError, requests.Timeout) as exc:
            termination, error = "timeout", f"{type(exc).__name__}: {exc}"
        except (EnvServiceError, requests.RequestException, ValueError) as exc:
            termination, error = "env_error", f"{type(exc).__name__}: {exc}"
        finally:
            if session is not None:
                self._release(session)
            recorded = self.gateway.close_episode(self.episode_id)
        result = self._result(recorded, session, termination, error, score, success)
        result.env_time_s = session.env_time_s if session is not None else 0.0
        result.wall_time_s = time.monotonic() - started
        return result

    def _call_agent(self, context: AgentContext) -> None:
        outcome = self.agent(context)
        if inspect.isawaitable(outcome):
            asyncio.run(_awaited(outcome))

    def _release(self, session: EnvSession) -> None:
        try:
            self.env.release(session.session_id)
        except (EnvServiceError, requests.RequestException):
            pass  # the service's reaper frees it; the episode's outcome stands

    def _result(self, recorded: GatewayEpisode, session: EnvSession | None, termination: str | None,
                error: str | None, score: float, success: bool) -> EpisodeResult:
        """The episode's result: the last segment's tokens, its turns' step rewards and anchors, the reward from
        the episode's task; a per_call episode's earlier segments as `earlier_segments`, scored alike."""
        if termination is None and recorded.infra_failures:
            termination, error = "llm_error", recorded.infra_failures[0]
        if termination is None and recorded.limit_reached:  # the agent's own doing: scored, like a round limit
            termination = recorded.limit_reached
        last = recorded.segments[-1] if recorded.segments else None
        if termination is None:
            termination = last.termination if last is not None and last.termination else session.termination
        # Rule: a limit cut is a forfeit here as in our own loop (episode_loop.py): stalling until the limit never
        # beats losing.
        forfeit = session.credit_forfeit(len(recorded.calls)) if session and termination in LIMIT_CUTS else None
        # The whole episode's step rewards, over all of its calls.
        step_rewards, _ = session.turn_rewards_and_anchors(0, len(recorded.calls)) if session else ([], [])
        reward = 0.0
        if termination not in INFRA_FAILURES:
            outcome = EpisodeOutcome(score=score, success=success, step_rewards=tuple(step_rewards),
                                     termination=termination, rounds=len(step_rewards))
            reward = float(self.spec.agent_task.reward(outcome))
        samples = [self._segment_result(recorded, index, session, termination, reward, success, score)
                   for index in range(len(recorded.segments))]
        for index, sample in enumerate(samples):  # a segment's returns run on through the later segments' turns
            sample.later_step_rewards = [r for later in samples[index + 1:] for r in later.step_rewards]
        head = samples[-1] if samples else EpisodeResult(spec=self.spec, episode=None, termination=termination)
        return dataclasses.replace(
            head, termination=termination, reward=reward, success=success, score=score, rounds=len(step_rewards),
            error=error, llm_time_s=sum(call.latency_s for call in recorded.calls), agent_mode=recorded.mode,
            earlier_segments=samples[:-1], forfeit=forfeit)

    def _segment_result(self, recorded: GatewayEpisode, index: int, session: EnvSession | None, termination: str,
                        reward: float, success: bool, score: float) -> EpisodeResult:
        """One segment (training sample) of the episode: its tokens, and the step rewards and anchors of its own
        calls. It ends as the episode did, unless it ended itself first (e.g. `length`, when the agent went on in
        a new history); an infrastructure failure of the episode is every segment's."""
        handler = recorded.segments[index]
        calls = [call.index for call in recorded.calls if call.segment == index]
        step_rewards, anchors = (session.turn_rewards_and_anchors(calls[0], calls[-1] + 1)
                                 if session is not None and calls else ([], []))
        ended = termination if termination in INFRA_FAILURES or not handler.termination else handler.termination
        handler.finish(ended)
        handler.reward, handler.step_rewards = reward, list(step_rewards)
        episode = handler.to_episode()
        episode.termination = ended  # an infra failure after a length stop is still a failure
        return EpisodeResult(spec=self.spec, episode=episode, termination=ended, reward=reward, success=success,
                             score=score, step_rewards=step_rewards, anchors=anchors, rounds=len(step_rewards),
                             messages=list(handler.messages), agent_mode=recorded.mode)


class AgentEnvManager(ParallelEnvManager):
    """A `ParallelEnvManager` whose episodes are played by a user's agent behind the gateway (`AgentEpisodeLoop`)."""

    def __init__(self, env_client: Any, generate: GenerateFn, tokenizer: Any, config: EpisodeConfig,
                 gateway: Gateway, gateway_url: str, agent: Callable[[AgentContext], Any], max_workers: int = 64,
                 gateway_socket: str | None = None):
        super().__init__(env_client, generate, tokenizer, config, max_workers)
        self.gateway, self.gateway_url, self.agent = gateway, gateway_url, agent
        self.gateway_socket = gateway_socket

    def episode_loop(self, spec: EpisodeSpec, max_rounds: int) -> AgentEpisodeLoop:  # type: ignore[override]
        """The AgentEpisodeLoop for one episode (sampled by this manager's `generate`; seeded in the order the agent's
        calls reach the gateway, which is the episode's own order unless the agent calls in parallel)."""
        return AgentEpisodeLoop(spec, self.env_client, self.gateway, self.gateway_url, self.agent,
                             self.config, max_rounds, seeded(self.generate, spec.sampling_seed), self.gateway_socket)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
