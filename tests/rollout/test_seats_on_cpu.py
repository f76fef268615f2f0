"""SeatedEpisodeLoop (beyond_agent/rollout/seats.py): one TicTacToe game, a policy per seat, against a real envservice
over loopback with the tiny model's tokenizer. Each seat's episode holds only its own view and exactly the ids its
policy wrote; outcomes, step rewards, groups, seeds and every way a game can end are checked by hand."""

from __future__ import annotations

import dataclasses
import re
import zlib

import pytest

from envservice.client import EnvClient
from envservice.envs.two_player import SEAT_REWARDS
from envservice.server import EnvServiceConfig, create_app
from beyond_agent.actions import ParsedAction
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.llm import GenerationResult, LLMError, request_seed
from beyond_agent.tasks import AgentTask
from beyond_agent.trajectories import episode_record
from beyond_agent.rollout.seats import (SeatedEpisodeLoop, SelfPlayConfig, SelfPlayEpisodeLoop, SelfPlayEnvManager,
                                        seat_metrics)

pytestmark = pytest.mark.timeout(120)
LIMITS = dict(max_prompt_length=1024, max_response_length=2048, max_tokens_per_turn=16)
ROUNDS = 9
"""The round limit where a test does not set its own."""


class Moves:
    """A seat's policy: writes the given replies in turn (the tokenizer's ids plus end-of-turn), recording the ids,
    the prompts it was shown and the seeds it was asked to sample with."""

    def __init__(self, tokenizer, replies: list[str], fail_at: int | None = None):
        self.tokenizer, self.replies, self.fail_at = tokenizer, replies, fail_at
        self.sampled: list[list[int]] = []
        self.prompts: list[str] = []
        self.seeds: list[int | None] = []

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None = None):
        if len(self.sampled) == self.fail_at:
            raise LLMError("connection", "server went away (scripted)")
        ids = (self.tokenizer.encode(self.replies[len(self.sampled)], add_special_tokens=False)
               + [self.tokenizer.eos_token_id])[:max_tokens]
        self.sampled.append(ids)
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        self.seeds.append(seed)
        return GenerationResult(token_ids=ids, logprobs=[-0.25] * len(ids), stop_reason="stop", latency_s=0.0)


@pytest.fixture(scope="module")
def service_url(serve_app):
    with serve_app(create_app(EnvServiceConfig(env_ids=["tictactoe", "frozenlake"], max_sessions=16))) as url:
        yield url


@pytest.fixture
def client(service_url):
    with EnvClient(service_url, timeout=10, retries=0) as client:
        yield client
    with EnvClient(service_url) as probe:
        assert probe.health().sessions == 0  # every game released its session


def game(opening_moves: int = 0, **fields) -> EpisodeSpec:
    return EpisodeSpec("tictactoe", task_id=0, seed=0, params={"opponent": "none", "opening_moves": opening_moves},
                       group_id="pos0", **fields)


def play(client, tokenizer, seat0, seat1, spec=None, max_rounds=ROUNDS, **limits):
    policies = {0: Moves(tokenizer, seat0[0], **seat0[1]), 1: Moves(tokenizer, seat1[0], **seat1[1])}
    results = SeatedEpisodeLoop(spec or game(), client, policies, tokenizer,
                             EpisodeConfig(**{**LIMITS, **limits}), max_rounds).run()
    return results, policies


def trained_ids(result) -> list[int]:
    episode = result.episode
    return [token for token, mask in zip(episode.response_ids, episode.response_mask) if mask]


def test_each_seat_trains_on_its_own_moves_and_sees_its_own_view(client, chatml_tokenizer):
    """Seat 0 (O) takes 0, 1, 2 and wins; seat 1 (X) took 3 and 4 and loses. Each seat's masked ids are exactly
    what its policy wrote; each seat's prompts show the opponent's moves, never the opponent's raw text."""
    results, policies = play(client, chatml_tokenizer, (["[0]", "I take [1]", "[2]"], {}),
                             (["[3]", "my move: [4]"], {}))
    assert [r.spec.seat for r in results] == [0, 1] and [r.spec.group_id for r in results] == ["pos0/seat0", "pos0/seat1"]
    assert [r.termination for r in results] == ["done", "done"]
    assert [(r.score, r.success, r.reward) for r in results] == [(1.0, True, 1.0), (0.0, False, 0.0)]
    assert [r.rounds for r in results] == [3, 2]
    assert results[0].step_rewards == [0.0, 0.0, 1.0] and results[1].step_rewards == [0.0, -1.0]
    for result, policy in zip(results, policies.values()):
        assert trained_ids(result) == [token for ids in policy.sampled for token in ids]
        assert {lp for lp, m in zip(result.episode.response_logprobs, result.episode.response_mask) if m} == {-0.25}
    assert "Player 1 placed their symbol (X) in cell 3." in policies[0].prompts[1]
    assert "my move" not in policies[0].prompts[2] and "I take" not in policies[1].prompts[1]
    assert "Player 0 placed their symbol (O) in cell 1." in policies[1].prompts[1]
    assert len(set(results[0].anchors)) == 3 and not set(results[0].anchors) & set(results[1].anchors)


def test_a_seats_reply_without_a_move_is_answered_to_that_seat_alone(client, chatml_tokenizer):
    """Seat 1's 'hmm' holds no cell: the game warns seat 1, which moves again; seat 0 never sees it. A draw
    (0 -> 4 -> 8 -> 2 -> 6 -> 3 -> 5 -> 7 -> 1) scores both seats 0.5."""
    results, policies = play(client, chatml_tokenizer, (["[0]", "[8]", "[6]", "[5]", "[1]"], {}),
                             (["hmm", "[4]", "[2]", "[3]", "[7]"], {}))
    assert [r.termination for r in results] == ["done", "done"] and [r.score for r in results] == [0.5, 0.5]
    assert "Player 1 attempted an invalid move" in policies[1].prompts[1]
    assert not any("hmm" in p or "invalid move" in p for p in policies[0].prompts)
    assert results[1].step_rewards == [0.0, 0.0, 0.0, 0.0, 0.0] and results[0].step_rewards[-1] == 0.0
    assert [r.refused_turns for r in results] == [0, 1]  # 'hmm' is no move
    assert [r.rounds for r in results] == [5, 5]


def test_the_round_limit_cuts_the_game_and_the_seat_it_stopped_forfeits(client, chatml_tokenizer):
    """Two rounds each, then seat 0 is to move with none left: it loses the game and seat 1 wins it, also on each
    seat's last move (a draw for both would pay a losing seat to stall)."""
    results, _ = play(client, chatml_tokenizer, (["[0]", "[1]", "[5]"], {}), (["[4]", "[8]", "[6]"], {}),
                      max_rounds=2)
    assert [r.termination for r in results] == ["max_rounds", "max_rounds"]
    assert [(r.score, r.success, r.rounds) for r in results] == [(0.0, False, 2), (1.0, True, 2)]
    assert [r.step_rewards for r in results] == [[0.0, -1.0], [0.0, 1.0]]


def test_an_llm_failure_of_one_seat_voids_the_game_for_both(client, chatml_tokenizer):
    results, _ = play(client, chatml_tokenizer, (["[0]", "[1]"], {}), (["[4]", "[8]"], {"fail_at": 1}))
    assert [r.termination for r in results] == ["llm_error", "llm_error"]
    assert all(r.infra_failure and r.reward == 0.0 for r in results)
    results, _ = play(client, chatml_tokenizer, (["[0]"], {"fail_at": 0}), (["[4]"], {}))  # before seat 1 moved
    assert [(r.termination, r.spec.seat) for r in results] == [("llm_error", 0)]


def test_a_seat_without_a_policy_or_a_one_player_env_is_an_env_error_before_any_move(client, chatml_tokenizer):
    """Seat 0 is to move and only seat 1 has a policy; FrozenLake names no seat. Each game is void before any seat
    moved, and is accounted for by one result without an episode."""
    policies = {1: Moves(chatml_tokenizer, ["[4]"])}
    [result] = SeatedEpisodeLoop(game(), client, policies, chatml_tokenizer, EpisodeConfig(**LIMITS), ROUNDS).run()
    assert (result.termination, result.episode, result.spec.seat) == ("env_error", None, 1)
    assert "the env named seat 0 to move; this game has policies for seats [1]" in result.error
    results, _ = play(client, chatml_tokenizer, (["left"], {}), (["right"], {}),
                      spec=EpisodeSpec("frozenlake", task_id=0, seed=0, group_id="map0"))
    assert [(r.termination, r.spec.seat, r.episode) for r in results] == [("env_error", 0, None)]
    assert "the env named seat None to move" in results[0].error


def test_against_an_opponent_inside_the_env_only_the_clients_seat_plays(client, chatml_tokenizer):
    """`first` plays seat 1 (X) inside each step (the lowest free cell): O takes 4, 8, 2 and wins on 2-4-6 while X
    took 0, 1, 3. Only seat 0 moved, so it alone has a result."""
    spec = EpisodeSpec("tictactoe", task_id=0, seed=0, params={"opponent": "first", "opening_moves": 0},
                       group_id="pos0")
    results, policies = play(client, chatml_tokenizer, (["[4]", "[8]", "[2]", "[6]"], {}), (["[5]"], {}), spec=spec)
    assert [(r.spec.seat, r.termination, r.success, r.rounds) for r in results] == [(0, "done", True, 4)]
    assert policies[1].sampled == []


def test_each_seat_samples_with_its_own_seeds(client, chatml_tokenizer):
    """A seeded game gives seat k's turn t the seed request_seed(request_seed(game seed, 'seat', k), t): two seats of
    one model never sample alike."""
    results, policies = play(client, chatml_tokenizer, (["[0]", "[1]", "[2]"], {}), (["[3]", "[4]"], {}),
                             spec=game(sampling_seed=7))
    for seat, policy in policies.items():
        seat_seed = request_seed(7, "seat", seat)
        assert policy.seeds == [request_seed(seat_seed, turn) for turn in range(len(policy.sampled))]
    assert results[0].spec.sampling_seed == 7


def test_each_seats_figures_count_its_wins_draws_losses_and_cut_games(client, chatml_tokenizer):
    """Three self-play games: seat 0 wins (0, 1, 2 against 3, 4, after seat 1's refused [0]), a draw, and a game cut
    by the round limit of 2. Seat 0: 1 win, 1 draw, 1 cut of 3; seat 1: 1 loss, 1 draw, 1 cut, 1 refused turn."""
    scripts = {"A": (["[0]", "[1]", "[2]"], ["[0]", "[3]", "[4]"]),  # seat 1's [0]: an occupied cell, refused
               "B": (["[0]", "[8]", "[6]", "[5]", "[1]"], ["[4]", "[2]", "[3]", "[7]"]),
               "C": (["[0]", "[1]", "[5]"], ["[4]", "[8]", "[6]"])}
    results = []
    for name, (seat0, seat1) in scripts.items():
        policies = {0: Moves(chatml_tokenizer, seat0), 1: Moves(chatml_tokenizer, seat1)}
        first = SelfPlayEpisodeLoop(SeatedEpisodeLoop(game(), client, policies, chatml_tokenizer, EpisodeConfig(**LIMITS),
                                                2 if name == "C" else ROUNDS)).run()
        assert first.spec.seat == 0 and [other.spec.seat for other in first.other_seats] == [1]
        results.append(first)
    figures = seat_metrics(results, prefix="beyond_agent/")
    third, sixth = pytest.approx(1 / 3), pytest.approx(1 / 6)
    assert figures == {"beyond_agent/seat0/episodes": 3.0, "beyond_agent/seat0/win": third,
                       "beyond_agent/seat0/draw": third, "beyond_agent/seat0/loss": 0.0, "beyond_agent/seat0/cut": third,
                       "beyond_agent/seat1/episodes": 3.0, "beyond_agent/seat1/win": 0.0,
                       "beyond_agent/seat1/draw": third, "beyond_agent/seat1/loss": third, "beyond_agent/seat1/cut": third,
                       "beyond_agent/seat0/refused_turns": 0.0, "beyond_agent/seat1/refused_turns": third,
                       # Against itself: both seats of the three games, 6 episodes.
                       "beyond_agent/opponent/self/episodes": 6.0, "beyond_agent/opponent/self/win": sixth,
                       "beyond_agent/opponent/self/draw": third, "beyond_agent/opponent/self/loss": sixth,
                       "beyond_agent/opponent/self/cut": third, "beyond_agent/opponent/self/refused_turns": sixth}
    assert seat_metrics([]) == {}


class FirstFreeCell:
    """One policy for every seat: the first move TextArena lists as available in the prompt's last board."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seeds = tokenizer, []

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int, seed: int | None = None):
        self.seeds.append(seed)
        available = self.tokenizer.decode(prompt_ids).rsplit("Available Moves: ", 1)[1]
        ids = self.tokenizer.encode(available.split(",")[0].strip("'"), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return GenerationResult(token_ids=ids, logprobs=[-0.1] * len(ids), stop_reason="stop", latency_s=0.0)


def test_the_self_play_manager_plays_each_spec_as_a_game_of_the_policy_against_itself(client, chatml_tokenizer):
    """Two seeded specs of one row, the policy in both seats: each comes back as seat 0's result with seat 1's in
    `other_seats`; on the empty board 'first free cell' against itself fills 0..6 and seat 0 wins on 2-4-6."""
    policy = FirstFreeCell(chatml_tokenizer)
    manager = SelfPlayEnvManager(client, policy, chatml_tokenizer, EpisodeConfig(**LIMITS),
                                 SelfPlayConfig(envs=("tictactoe",)), max_workers=2)
    specs = [game(index=index, sampling_seed=request_seed(3, index)) for index in range(2)]
    output = manager.run(specs + [EpisodeSpec("frozenlake", task_id=0, seed=0, group_id="map0", index=2)], ROUNDS)
    assert output.results[2].spec.seat is None and output.results[2].other_seats == []  # a one-player env: as usual
    output.results = output.results[:2]
    for result in output.results:
        assert (result.spec.seat, result.termination, result.success, result.rounds) == (0, "done", True, 4), result.error
        [other] = result.other_seats
        assert (other.spec.seat, other.spec.group_id, other.score, other.rounds) == (1, "pos0/seat1", 0.0, 3)
        assert episode_record(other, 1, "train").extra["seat"] == 1 and episode_record(other, 1, "train").group == "pos0/seat1"
    seeds = [seed for seed in policy.seeds if seed is not None]  # FrozenLake's episode is not seeded
    assert len(seeds) == 14 and len(set(seeds)) == 14  # each game's seats sample with seeds of their own
    with pytest.raises(ValueError, match="self_play.seats must be an integer >= 2, got 1"):
        SelfPlayConfig(envs=("tictactoe",), seats=1)
    assert not SelfPlayConfig().active and SelfPlayConfig(envs=["tictactoe"]).envs == ("tictactoe",)


def test_each_rows_games_face_one_opponent_of_the_pool_drawn_by_weight(client, chatml_tokenizer):
    """The pool {self: 1, first: 1}: every game of a row faces the same opponent, about half the rows each. Against
    `first` the env plays seat 1 inside its steps: on the empty board 'first free cell' (O) takes 0, 2, 4, 6 while
    X takes 1, 3, 5, and wins alone, its episode recording the opponent."""
    pool = SelfPlayConfig(envs=("tictactoe",), opponents={"self": 1.0, "first": 1.0})
    drawn = [pool.opponent_for(f"row{i}") for i in range(2000)]
    assert drawn == [pool.opponent_for(f"row{i}") for i in range(2000)] and 900 < drawn.count("self") < 1100
    assert {SelfPlayConfig(envs=("t",), opponents={"perfect": 3}).opponent_for(f"row{i}") for i in range(50)} == {
        "perfect"}
    row = next(f"row{i}" for i, name in enumerate(drawn) if name == "first")
    policy = FirstFreeCell(chatml_tokenizer)
    manager = SelfPlayEnvManager(client, policy, chatml_tokenizer, EpisodeConfig(**LIMITS), pool, max_workers=2)
    results = manager.run([dataclasses.replace(game(index=index), group_id=row) for index in range(2)], ROUNDS).results
    for result in results:
        assert (result.spec.seat, result.success, result.rounds, result.other_seats) == (0, True, 4, [])
        assert result.spec.params["opponent"] == "first" and episode_record(result, 1, "train").extra == {
            "seat": 0, "opponent": "first"}
    assert seat_metrics(results)["opponent/first/win"] == 1.0
    for bad in ({}, {"self": 0}, {"none": 1.0}, {"self": True}):
        with pytest.raises(ValueError, match="self_play.opponents must map opponent names"):
            SelfPlayConfig(envs=("tictactoe",), opponents=bad)
    validated = dataclasses.replace(pool, validation_opponent="perfect").for_validation()
    assert validated.opponents == {"perfect": 1.0} and {validated.opponent_for(f"row{i}") for i in range(20)} == {
        "perfect"}
    assert pool.for_validation() is pool
    with pytest.raises(ValueError, match="validation_opponent must be an opponent's name"):
        SelfPlayConfig(envs=("tictactoe",), validation_opponent="none")


class AnyCell(AgentTask):
    """A reply `[k]` is that cell; any other reply the cell crc32(reply) mod 9 (the tiny model writes no cells)."""

    def parse(self, text: str) -> ParsedAction:
        cell = re.fullmatch(r"\[(\d)\]", text.strip())
        return ParsedAction(action=f"[{cell.group(1) if cell else zlib.crc32(text.encode()) % 9}]", error=None)


def test_against_a_frozen_model_the_policy_plays_the_first_seat_and_alone_trains(client, chatml_tokenizer,
                                                                                  tiny_vllm_server):
    """The pool's only opponent is a frozen model behind a real vLLM server (the tiny model). After 3 opening moves
    seat 1 moves first: the policy plays it, the model seat 0, and the game's one result is the policy's."""
    endpoint = {"url": tiny_vllm_server.base_url, "model": tiny_vllm_server.config.model, "temperature": 1.0}
    pool = SelfPlayConfig(envs=("tictactoe",), opponents={"ckpt": 1.0}, endpoints={"ckpt": endpoint})
    policy = FirstFreeCell(chatml_tokenizer)
    manager = SelfPlayEnvManager(client, policy, chatml_tokenizer, EpisodeConfig(**LIMITS), pool, max_workers=2)
    spec = EpisodeSpec("tictactoe", task_id=0, seed=0, params={"opening_moves": 3}, group_id="pos0",
                       agent_task=AnyCell())
    try:
        [result] = manager.run([spec], ROUNDS).results
        model = manager.models._fronts["ckpt"].metrics()
    finally:
        manager.models.close()
    assert (result.spec.seat, result.spec.opponent, result.other_seats) == (1, "ckpt", [])
    assert result.termination in ("done", "max_rounds") and not result.infra_failure
    assert len(policy.seeds) == result.rounds >= 1  # the scripted policy played seat 1's turns, and only those
    assert model.requests >= result.rounds - 1 and model.failures == 0  # the frozen model played seat 0's
    assert episode_record(result, 1, "train").extra == {"seat": 1, "opponent": "ckpt"}
    for bad in ({"ckpt": {"url": "http://h:1"}}, {"self": {"url": "http://h:1", "model": "m"}},
                {"ckpt": {"url": "http://h:1", "model": "m", "top_k": 3}}):
        with pytest.raises(ValueError, match="beyond_agent.self_play.endpoints"):
            SelfPlayConfig(envs=("tictactoe",), endpoints=bad)
