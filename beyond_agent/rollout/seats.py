"""One game with a policy per seat: one env session, one conversation per seat (issue #57).

An env with several seats names the seat to move in every answer (`info["seat"]`, envservice/envs/two_player.py)
and shows that seat's view. `SeatedEpisodeLoop` keeps one `EpisodeLoop` per seat, all on the same session: the seat to
move adds the observation to its own conversation, its own policy writes its move (the same model in self-play, an
earlier checkpoint or a scripted player as an opponent), and the env's answer says who moves next. So each seat's
conversation holds only its own view and its own sampled tokens, with the ids, masks and log-probs a one-player
episode has, and trains as an episode of its own.

How a game ends for its seats:
- the env ends it (`terminated`): every seat's termination is `done`, and its outcome is its entry in
  `info["seat_rewards"]` (zero-sum: 1, 0, -1). A seat's score is (outcome + 1) / 2 (win 1, draw 0.5, loss 0) and
  its success a win; its reward is its `AgentTask`'s reward of that outcome (the default task: the score). The
  mover's last step reward is the env's reward for its move, which is its outcome; every other seat's last move
  gets its own outcome as its step reward too, so that step-level credit (GiGPO) sees the result of the game on
  each seat's last move alike.
- a limit cuts it (a seat's round limit, the env's own step limit, a seat's response length): the game has no
  result; the seat the limit stopped forfeits it (outcome -1, as TextArena's rule loses a game for a seat that does
  not move) and every other seat wins it (1). Scored as a draw for all, a cut paid a seat that was losing to stall
  (envservice/envs/two_player.py tells how a policy learnt to). The stopped seat's last move is credited with the
  forfeit by the one-player loop's own rule (`EpisodeLoop._forfeit`: F, `FORFEIT` unless the env declares its own)
  and its result carries F (`EpisodeResult.forfeit`: GiGPO counts it undiscounted at every turn of that seat's
  episode, so a seat never gains by holding a position until the limit); every other seat's last move gets its
  walkover (1), an ordinary step reward. The seat that hit the length limit ends with `length`, the others with the
  reason that stopped the game for everyone (`max_rounds`, `truncated`).
- an infrastructure failure of any seat (`env_error`, `llm_error`, `timeout`) voids the game: every seat that moved
  ends with it (or, when none had, the seat to move, with a result without an episode), and none is trained
  (`EpisodeResult.infra_failure`).
A seat that never moved in a game the env ended (it ended before that seat's first turn, or an opponent inside the
env played that seat: `params.opponent` other than `none`) has no conversation and no result.

**Self-play in training** (`beyond_agent.self_play`, `SelfPlayConfig`): `SelfPlayEnvManager` plays each episode of
the listed envs as such a game against the row's opponent from a pool: the policy itself in every seat, a frozen
model behind a vLLM endpoint (the policy plays the seat to move first: `SeatOrder`), or a scripted player inside
the env; other envs of a multi-task run play as usual. Verl joins the rollout's rows one to one with its input
rows, so a game comes back as one result, its first seat's, carrying the other seats the policy played in
`other_seats`; the trainer adds those as rows of their own (`rollout.batch.add_segment_rows`), and every seat's row
is grouped with the same seat's rows of the same dataset row (uid `<row uid>/seat<k>`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from envservice.envs.two_player import SEAT, SEAT_REWARDS
from beyond_agent.rollout.episode_loop import (FORFEIT, EpisodeLoop, EpisodeConfig, EpisodeResult, EpisodeSpec,
                                               Forfeit, GenerateFn, _EpisodeFailure, seeded, state_anchor)
from beyond_agent.rollout.env_manager import ParallelEnvManager
from beyond_agent.rollout.handler import RolloutHandler
from beyond_agent.rollout.llm import request_seed

WALKOVER = 1.0
"""The outcome of a game a limit cut before its end for every seat but the one the limit stopped, which forfeits
(`FORFEIT`, -1, episode_loop.py: one forfeit for the one-player and the seated loops)."""

SELF = "self"
"""The opponent that is the policy itself: every seat of the game is the policy's, and every seat trains."""
OPPONENT_PARAM = "opponent"
"""The task param by which a seated env is told who plays the seats no client plays: `none` (clients play every
seat), or the name of one of its scripted opponents (envservice/envs/two_player.py)."""


class _LastAnswer:
    """The env client, keeping its last create or step answer: the seat to move is in its info."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.info: Mapping[str, Any] = {}

    def create(self, *args: Any) -> Any:
        answer = self.client.create(*args)
        self.info = getattr(answer, "info", None) or {}
        return answer

    def step(self, *args: Any) -> Any:
        answer = self.client.step(*args)
        self.info = getattr(answer, "info", None) or {}
        return answer

    def evaluate(self, *args: Any) -> Any:
        return self.client.evaluate(*args)

    def release(self, *args: Any) -> Any:
        return self.client.release(*args)


@dataclass(frozen=True)
class SeatOrder:
    """Policies by the order of play instead of by seat number: `first` plays the seat the env names to move first
    (known once the game is created: after a random opening, either seat), `rest` every other seat."""

    first: GenerateFn
    rest: GenerateFn
    seats: int = 2


@dataclasses.dataclass
class _Seat:
    """One seat's episode in progress: its EpisodeLoop (rounds, step rewards, anchors, timings) and conversation."""

    loop: EpisodeLoop
    handler: RolloutHandler | None = None
    termination: str | None = None


class SeatedEpisodeLoop:
    """Plays one game of `spec` with `policies[seat]` writing each seat's moves; see the module docstring.

    Args:
        spec: the game (env, task, params; `params.opponent: none` for a game whose every seat is played here).
            Each seat's result carries a copy with `seat` and `opponent` set and `group_id` suffixed `/seat<k>`:
            GRPO then compares a seat's episodes with the same seat's in other games of the task (a seat's
            outcome is the negative of its opponent's, so a group of both seats would only learn which seat won).
        env_client: the envservice client.
        policies: seat -> its generate function (every seat the env may name must have one), or a `SeatOrder`.
        tokenizer, config, max_rounds: as for `EpisodeLoop` (the round limit counts each seat's turns).
    """

    def __init__(self, spec: EpisodeSpec, env_client: Any, policies: Mapping[int, GenerateFn] | SeatOrder,
                 tokenizer: Any, config: EpisodeConfig, max_rounds: int) -> None:
        self.spec = spec
        self.env = _LastAnswer(env_client)
        self.config = config
        self.max_rounds = max_rounds
        self.order = policies if isinstance(policies, SeatOrder) else None
        by_seat = {seat: self.order.rest for seat in range(self.order.seats)} if self.order else dict(policies)
        self.seats = {seat: _Seat(EpisodeLoop(self._seat_spec(seat), self.env, seeded(generate, self._seed(seat)),
                                           tokenizer, config, max_rounds))
                      for seat, generate in sorted(by_seat.items())}
        self.forfeit = Forfeit()
        """The game's F: one env session, so its seats share what its answers tell (each seat's loop notes them)."""
        for seat in self.seats.values():
            seat.loop.forfeit = self.forfeit
        self.first_seat: int | None = None
        """The seat the env named to move first (set once the game is created)."""

    def run(self) -> list[EpisodeResult]:
        """Play the game; one result per seat that moved, in seat order. Never raises; releases the session."""
        started = time.monotonic()
        for seat in self.seats.values():
            seat.loop._deadline = started + self.config.episode_timeout_s
        opener, session_id = next(iter(self.seats.values())).loop, None
        try:
            session_id, observation = opener._create_session()
            self.first_seat = self._seat_to_move()
            if self.order is not None:  # the first mover's policy, now that the env has named it
                first = self.seats[self.first_seat].loop
                first.generate = seeded(self.order.first, self._seed(self.first_seat))
            outcomes = self._play(session_id, observation)
            results = [self._scored(seat, outcomes) for seat in self._moved()]
        except _EpisodeFailure as failure:  # the seats that moved, or the one to move: the game is accounted for
            failed = self._moved() or [self.seats[self.first_seat if self.first_seat is not None else min(self.seats)]]
            results = [seat.loop._result(seat.handler, failure.termination, error=str(failure)) for seat in failed]
        finally:
            opener._release(session_id)
        for result in results:
            result.wall_time_s = time.monotonic() - started
        return results

    # ---- the game ----------------------------------------------------------------------------------

    def _play(self, session_id: str, observation: str) -> dict[int, float]:
        """Seats move in the order the env names them until the game ends; each seat's outcome."""
        while True:
            number = self._seat_to_move()
            seat = self.seats[number]
            seat.loop._state = state_anchor(observation, self.env.info)
            if seat.handler is None:
                seat.handler = seat.loop._new_handler(observation)
            else:
                seat.handler.add_observation(observation)
            stop = self._limit(seat)
            if stop is not None:
                return self._cut(number, stop)
            seat.loop._rounds += 1
            turn = seat.loop._generate(seat.handler)
            seat.handler.add_generated(turn)
            seat.loop._anchors.append(seat.loop._state)
            if seat.handler.done:  # the reply hit max_response_length: the env does not step
                seat.loop._step_rewards.append(0.0)
                return self._cut(number, "length")
            observation, ended = seat.loop._act(session_id, turn.token_ids)
            if ended == "done":
                return self._finish(number)
            if ended is not None:  # the env's own step limit
                return self._cut(number, ended)

    def _limit(self, seat: _Seat) -> str | None:
        """Why `seat` cannot take another turn, or None."""
        if seat.handler.done or seat.handler.remaining_response_length <= 0:
            return "length"  # the observation filled the response
        if seat.loop._rounds >= self.max_rounds:
            return "max_rounds"
        return None

    def _seat_to_move(self) -> int:
        seat = self.env.info.get(SEAT)
        if seat not in self.seats:
            raise _EpisodeFailure("env_error", f"the env named seat {seat!r} to move; this game has policies for "
                                  f"seats {sorted(self.seats)} (a one-player env, or params.opponent not `none`?)")
        return seat

    def _finish(self, mover: int) -> dict[int, float]:
        """The env ended the game: each seat's outcome, also as its last move's step reward."""
        rewards = self.env.info.get(SEAT_REWARDS)
        try:
            outcomes = {int(seat): float(value) for seat, value in rewards.items()}
        except (AttributeError, TypeError, ValueError) as exc:
            raise _EpisodeFailure("env_error", f"a finished game's info[{SEAT_REWARDS!r}] must map each seat to "
                                  f"its outcome; got {rewards!r}") from exc
        missing = [seat.loop.spec.seat for seat in self._moved() if seat.loop.spec.seat not in outcomes]
        if missing:
            raise _EpisodeFailure("env_error", f"info[{SEAT_REWARDS!r}] has no outcome for seats {missing}")
        for seat in self.seats.values():
            seat.termination = "done"
        self._credit_last_moves(outcomes, besides=mover)  # the mover's step reward is the env's already
        return outcomes

    def _cut(self, stopped_by: int, reason: str) -> dict[int, float]:
        """A limit ended the game: `reason` for the seat it stopped, `max_rounds` / `truncated` for the others; that
        seat forfeits the game, the others win it by walkover."""
        outcomes = {number: FORFEIT if number == stopped_by else WALKOVER for number in self.seats}
        for number, seat in self.seats.items():
            seat.termination = reason if number == stopped_by or reason != "length" else "truncated"
        # Rule: the stopped seat forfeits as a one-player episode a limit cuts does (one rule: EpisodeLoop._forfeit),
        # so its episode carries the forfeit GiGPO counts at every turn; the others' walkover is a plain step reward.
        stopped = self.seats[stopped_by]
        if stopped.handler is not None:
            stopped.loop._forfeit()
        self._credit_last_moves(outcomes, besides=stopped_by)
        return outcomes

    def _credit_last_moves(self, outcomes: dict[int, float], besides: int | None = None) -> None:
        """Each seat that moved (but `besides`) gets its outcome as its last move's step reward, so that step-level
        credit sees the game's result on every seat's last move alike."""
        for number, seat in self.seats.items():
            if number != besides and seat.handler is not None and seat.loop._step_rewards:
                seat.loop._step_rewards[-1] = outcomes[number]

    def _scored(self, seat: _Seat, outcomes: dict[int, float]) -> EpisodeResult:
        number = seat.loop.spec.seat
        outcome = outcomes[number]
        seat.handler.finish(seat.termination)
        return seat.loop._scored_result(seat.handler, (outcome + 1) / 2, outcome == 1)

    def _moved(self) -> list[_Seat]:
        return [seat for seat in self.seats.values() if seat.handler is not None]

    # ---- each seat's spec --------------------------------------------------------------------------

    def _seat_spec(self, seat: int) -> EpisodeSpec:
        opponent = self.spec.params.get(OPPONENT_PARAM)  # `none`: clients (here: these policies) play every seat
        return dataclasses.replace(self.spec, seat=seat, group_id=f"{self.spec.group_id}/seat{seat}",
                                   opponent=self.spec.opponent or (SELF if opponent in (None, "none") else str(opponent)))

    def _seed(self, seat: int) -> int | None:
        """Each seat's sampling seed: the game's, and the seat (two seats of one model must not sample alike)."""
        return None if self.spec.sampling_seed is None else request_seed(self.spec.sampling_seed, "seat", seat)


# ---- self-play in training ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelfPlayConfig:
    """`beyond_agent.self_play`: play the episodes of some envs as games against the policy itself or a pool of
    opponents."""

    envs: tuple[str, ...] = field(default_factory=list)  # type: ignore[assignment]  # a tuple once checked
    """Env ids whose episodes are such games (the env must name the seat to move, `info["seat"]`, and take
    `params.opponent`: e.g. `tictactoe`); the run's other envs play as usual. Empty: off."""
    seats: int = 2
    """Seats of those games."""
    opponents: Mapping[str, float] = field(default_factory=lambda: {SELF: 1.0})
    """The pool, opponent name -> weight: `self` (the policy in every seat, every seat trained) or a scripted
    opponent the env plays inside its steps (tictactoe: `random`, `first`, `perfect`; only the policy's seat
    trains). Each dataset row's games all face one opponent (so a GRPO group compares like with like), drawn by
    weight from a hash of the row's group id; each episode records it."""

    validation_opponent: str | None = None
    """The opponent of every validation game (e.g. `random` or `perfect`: a fixed player, so that validation
    measures the policy against the same opponent at every step); None: drawn from the pool like training's."""
    endpoints: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Opponents that are frozen models (an earlier checkpoint of the policy, say), by name: `{url, model,
    temperature}` of a vLLM server (OpenAI-compatible `/v1/completions` with token ids; the same tokenizer as the
    policy's). In a game against one, the policy plays the seat to move first and alone trains."""

    def __post_init__(self) -> None:
        envs = self.envs
        if isinstance(envs, str) or not all(isinstance(env, str) and env for env in envs):
            raise ValueError(f"beyond_agent.self_play.envs must be a list of env ids, got {envs!r}")
        object.__setattr__(self, "envs", tuple(envs))
        if isinstance(self.seats, bool) or not isinstance(self.seats, int) or self.seats < 2:
            raise ValueError(f"beyond_agent.self_play.seats must be an integer >= 2, got {self.seats!r}")
        opponents = self.opponents
        if not isinstance(opponents, Mapping) or not opponents or not all(
                isinstance(name, str) and name and name != "none" and isinstance(weight, (int, float))
                and not isinstance(weight, bool) and weight > 0 for name, weight in opponents.items()):
            raise ValueError(f"beyond_agent.self_play.opponents must map opponent names ({SELF!r} or the env's "
                             f"scripted opponents) to weights > 0, e.g. {{self: 2, random: 1}}; got {opponents!r}")
        object.__setattr__(self, "opponents", dict(opponents))
        if self.validation_opponent is not None and (not isinstance(self.validation_opponent, str)
                                                     or self.validation_opponent in ("", "none")):
            raise ValueError(f"beyond_agent.self_play.validation_opponent must be an opponent's name ({SELF!r}, an "
                             f"endpoint's or the env's scripted one) or null; got {self.validation_opponent!r}")
        if not isinstance(self.endpoints, Mapping):
            raise ValueError(f"beyond_agent.self_play.endpoints must map names to {{url, model}}, got {self.endpoints!r}")
        for name, endpoint in self.endpoints.items():
            where = f"beyond_agent.self_play.endpoints.{name}"
            if name == SELF or not isinstance(endpoint, Mapping):
                raise ValueError(f"{where} must be a mapping {{url, model, temperature}} under a name other than "
                                 f"{SELF!r}; got {endpoint!r}")
            unknown = sorted(set(endpoint) - {"url", "model", "temperature"})
            if unknown or not all(isinstance(endpoint.get(key), str) and endpoint.get(key) for key in ("url", "model")):
                raise ValueError(f"{where} needs url and model (strings) and takes temperature; got {dict(endpoint)!r}")
        object.__setattr__(self, "endpoints", {name: dict(endpoint) for name, endpoint in self.endpoints.items()})

    @property
    def active(self) -> bool:
        """Whether some env's episodes are played as games of several seats."""
        return bool(self.envs)

    def for_validation(self) -> "SelfPlayConfig":
        """The pool validation games draw from: `validation_opponent` alone, when set."""
        if self.validation_opponent is None:
            return self
        return dataclasses.replace(self, opponents={self.validation_opponent: 1.0}, validation_opponent=None)

    def opponent_for(self, group_id: str) -> str:
        """The opponent of a dataset row's games: drawn by weight from a hash of its group id (the same for all of
        the row's games, and in every process)."""
        names = sorted(self.opponents)
        draw = random.Random(request_seed(0, "opponent", group_id)).random() * sum(self.opponents.values())
        for name in names:
            draw -= self.opponents[name]
            if draw < 0:
                return name
        return names[-1]


class SelfPlayEpisodeLoop:
    """One dataset row's episode as a game of `SeatedEpisodeLoop`, returned as one result: the first seat's that has
    one, carrying the others in `other_seats` (module docstring)."""

    def __init__(self, game: SeatedEpisodeLoop) -> None:
        self.game = game

    def run(self) -> EpisodeResult:
        """Play the game (never raises). Against a frozen model (`SeatOrder`) only the policy's seat, the first to
        move, is a result: the model's moves are not the policy's to train on."""
        results = self.game.run()
        if self.game.order is not None and self.game.first_seat is not None:
            results = [result for result in results if result.spec.seat == self.game.first_seat]
        if not results:  # cannot happen: a failure gives every seat a result, the first mover always moves
            raise RuntimeError("a game ended without any seat's result")
        first, *others = results
        first.other_seats = others
        return first


class SelfPlayEnvManager(ParallelEnvManager):
    """A `ParallelEnvManager` whose episodes of `self_play.envs` are games with the policy in every seat."""

    def __init__(self, env_client: Any, generate: GenerateFn, tokenizer: Any, config: EpisodeConfig,
                 self_play: SelfPlayConfig, max_workers: int = 64, models: "OpponentModels | None" = None) -> None:
        super().__init__(env_client, generate, tokenizer, config, max_workers=max_workers)
        self.self_play = self_play
        self.models = models or OpponentModels(self_play.endpoints)
        """The frozen models of the pool (pass the run's own, so that their connections last across steps)."""

    def episode_loop(self, spec: EpisodeSpec, max_rounds: int) -> EpisodeLoop | SelfPlayEpisodeLoop:
        """The game of one episode spec of a self-play env against its row's opponent (each seat samples with its
        own seeds: `SeatedEpisodeLoop`); any other env's episode as usual."""
        if spec.env_id not in self.self_play.envs:
            return super().episode_loop(spec, max_rounds)
        opponent = self.self_play.opponent_for(spec.group_id)
        frozen = opponent in self.self_play.endpoints
        # Against a scripted opponent the env plays the other seats inside its steps and names only the policy's.
        env_plays = "none" if opponent == SELF or frozen else opponent
        game = dataclasses.replace(spec, params={**spec.params, OPPONENT_PARAM: env_plays}, opponent=opponent)
        policies: Mapping[int, GenerateFn] | SeatOrder = (
            SeatOrder(self.generate, self.models.generate(opponent), self.self_play.seats) if frozen
            else {seat: self.generate for seat in range(self.self_play.seats)})
        return SelfPlayEpisodeLoop(SeatedEpisodeLoop(game, self.env_client, policies, self.tokenizer, self.config,
                                                     max_rounds))


class OpponentModels:
    """The pool's frozen models (`SelfPlayConfig.endpoints`): one LLM front per endpoint, opened on first use."""

    def __init__(self, endpoints: Mapping[str, Mapping[str, Any]]) -> None:
        self.endpoints = endpoints
        self._fronts: dict[str, Any] = {}

    def generate(self, name: str) -> GenerateFn:
        """The generate function of the endpoint `name` at its temperature (default 1)."""
        from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, SamplingParams

        endpoint = self.endpoints[name]
        if name not in self._fronts:
            self._fronts[name] = AsyncLLMServerManager(HttpVLLMBackend([endpoint["url"]], endpoint["model"]))
        return self._fronts[name].with_sampling(SamplingParams(temperature=float(endpoint.get("temperature", 1.0))))

    def close(self) -> None:
        """Close every front opened."""
        for front in self._fronts.values():
            front.close()
        self._fronts.clear()


def seat_metrics(results: list[EpisodeResult], prefix: str = "") -> dict[str, float]:
    """Each seat's and each opponent's metrics over a rollout's games (`other_seats` included): `seat<k>/...` and
    `opponent/<name>/...`: `episodes`, and the shares of `win`, `draw` and `loss` among the games the env ended and
    of `cut` (a limit ended it), and `refused_turns` (replies that were no move or an illegal one, per episode), over
    the episodes that are not infrastructure failures. {} when no result played a
    seat."""
    seats: dict[str, list[EpisodeResult]] = {}
    for result in results:
        for seat_result in (result, *result.other_seats):
            if seat_result.spec.seat is not None:
                seats.setdefault(f"seat{seat_result.spec.seat}/", []).append(seat_result)
                seats.setdefault(f"opponent/{seat_result.spec.opponent}/", []).append(seat_result)
    metrics = {}
    for name, played in sorted(seats.items()):
        scored = [result for result in played if not result.infra_failure]
        ended = [result for result in scored if result.termination == "done"]
        metrics[f"{prefix}{name}episodes"] = float(len(played))
        for outcome, score in (("win", 1.0), ("draw", 0.5), ("loss", 0.0)):
            metrics[f"{prefix}{name}{outcome}"] = sum(result.score == score for result in ended) / max(len(scored), 1)
        metrics[f"{prefix}{name}cut"] = (len(scored) - len(ended)) / max(len(scored), 1)
        metrics[f"{prefix}{name}refused_turns"] = sum(r.refused_turns for r in scored) / max(len(scored), 1)
    return metrics
