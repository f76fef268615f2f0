"""TextArena single-player games (envservice/envs/textarena_games.py): the service contract, real strategies
that read the game's own text feedback and win (binary search, consistent-code elimination, GF(2) linear
algebra), determinism, invalid actions and params, and games won through a real service over loopback."""

from __future__ import annotations

import itertools
import random
import re
import threading
from typing import Callable

import pytest

from envservice import registry
from envservice.check import check_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY
from envservice.envs.textarena_games import GuessTheNumberEnv, LightsOutEnv, MastermindEnv
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess
from envservice.protocol import ErrorCode

pytestmark = pytest.mark.timeout(120)

ENV_IDS = {"textarena-guess-number": GuessTheNumberEnv, "textarena-mastermind": MastermindEnv,
           "textarena-lights-out": LightsOutEnv}

Step = Callable[[str], tuple[str, float, bool]]
"""Plays one action; returns (observation, reward, terminated): the same for an env in-process and over HTTP."""


def _task(cls, index: int, seed: int = 0, split: str = "train", **params):
    return cls.resolve_task(index, split, seed, params)


def _local(env) -> Step:
    def step(action: str) -> tuple[str, float, bool]:
        observation, reward, terminated, truncated, _ = env.step(action)
        assert not truncated
        return observation, reward, terminated

    return step


# --- strategies: each reads only the observations the player gets ------------------------------------------

def play_binary_search(first_observation: str, step: Step) -> tuple[str, float, bool, int]:
    """Guess the middle of the interval still possible; 'higher'/'lower' halves it. (last obs, reward, done, turns)"""
    low, high = map(int, re.search(r"between (\d+) and (\d+)", first_observation).groups())
    turns = int(re.search(r"within (\d+) turns", first_observation).group(1))
    for turn in range(1, turns + 1):
        guess = (low + high) // 2
        observation, reward, terminated = step(f"[{guess}]")
        if terminated:
            return observation, reward, terminated, turn
        if "higher" in observation:
            low = guess + 1
        elif "lower" in observation:
            high = guess - 1
        else:
            raise AssertionError(f"no hint in {observation!r}")
    raise AssertionError("the game did not end within its turns")


def play_mastermind(first_observation: str, step: Step) -> tuple[str, float, bool, int]:
    """Always guess a code consistent with every feedback so far (the pegs narrow the candidates)."""
    length = int(re.search(r"code that is (\d+) digits long", first_observation).group(1))
    numbers = int(re.search(r"each digit from 1 to (\d+)", first_observation).group(1))
    repeats = "with possible repeats" in first_observation
    digits = range(1, numbers + 1)
    candidates = list(itertools.product(digits, repeat=length) if repeats else itertools.permutations(digits, length))
    for turn in itertools.count(1):
        guess = candidates[0]
        observation, reward, terminated = step("[" + " ".join(map(str, guess)) + "]")
        if terminated:
            return observation, reward, terminated, turn
        feedback = re.search(r"Feedback: (\d+) black peg\(s\), (\d+) white peg\(s\)", observation)
        black, white = map(int, feedback.groups())
        candidates = [code for code in candidates if _pegs(code, guess) == (black, white)]
        assert candidates, "no code fits the feedback"
    raise AssertionError("unreachable")


def _pegs(secret: tuple[int, ...], guess: tuple[int, ...]) -> tuple[int, int]:
    black = sum(s == g for s, g in zip(secret, guess))
    common = sum(min(secret.count(d), guess.count(d)) for d in set(guess))
    return black, common - black


def parse_lights(observation: str) -> list[list[bool]]:
    """The grid of the last 'Current grid state' in an observation ('O' on, '.' off)."""
    block = observation.rsplit("Current grid state", 1)[1]
    return [[cell == "O" for cell in row.split()] for row in re.findall(r"^\d+: ([.O ]+)$", block, re.MULTILINE)]


def lights_out_presses(grid: list[list[bool]]) -> list[tuple[int, int]]:
    """The fewest presses that switch every light off: solve A x = b over GF(2), then try the null space."""
    n = len(grid)
    cells = [(r, c) for r in range(n) for c in range(n)]
    rows = []  # one equation per light: the presses that toggle it, as a bit mask, and whether it is on
    for r, c in cells:
        mask = 0
        for index, (pr, pc) in enumerate(cells):
            if abs(pr - r) + abs(pc - c) <= 1:
                mask |= 1 << index
        rows.append([mask, int(grid[r][c])])
    pivots, rank = [], 0
    for column in range(len(cells)):
        pivot = next((i for i in range(rank, len(rows)) if rows[i][0] >> column & 1), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        for i in range(len(rows)):
            if i != rank and rows[i][0] >> column & 1:
                rows[i][0] ^= rows[rank][0]
                rows[i][1] ^= rows[rank][1]
        pivots.append(column)
        rank += 1
    assert all(bit == 0 for mask, bit in rows[rank:]), "the grid has no solution"
    free = [column for column in range(len(cells)) if column not in pivots]
    best = None
    for choice in itertools.product((0, 1), repeat=len(free)):
        x = dict(zip(free, choice))
        for i, column in enumerate(pivots):
            value = rows[i][1]
            for other in free:
                if rows[i][0] >> other & 1:
                    value ^= x[other]
            x[column] = value
        presses = [cells[column] for column in sorted(x) if x[column]]
        if best is None or len(presses) < len(best):
            best = presses
    return best


def play_lights_out(first_observation: str, step: Step) -> tuple[str, float, bool, int]:
    """Press the cells of the fewest-presses solution of the grid shown."""
    observation, reward, terminated, turns = first_observation, 0.0, False, 0
    for row, col in lights_out_presses(parse_lights(first_observation)):
        observation, reward, terminated = step(f"[{row} {col}]")
        turns += 1
    return observation, reward, terminated, turns


STRATEGIES = {GuessTheNumberEnv: play_binary_search, MastermindEnv: play_mastermind, LightsOutEnv: play_lights_out}


# --- tests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_check_env_passes(env_id: str) -> None:
    assert "garbage_actions" in check_env(env_id)
    assert registry.get(env_id).origin.startswith("plugin")


@pytest.mark.parametrize("cls, params", [
    (GuessTheNumberEnv, {}),
    (GuessTheNumberEnv, {"max_number": 1000, "max_turns": 10}),
    (MastermindEnv, {}),
    (MastermindEnv, {"code_length": 3, "num_numbers": 5, "duplicates": True, "max_turns": 12}),
    (LightsOutEnv, {}),
    (LightsOutEnv, {"size": 3}),
    (LightsOutEnv, {"size": 4}),
])
def test_strategy_wins_every_task(cls, params: dict) -> None:
    env = cls()
    for index in range(25):
        split = "train" if index % 3 else "test"
        observation, info = env.reset(_task(cls, index, seed=index + 100, split=split, **params))
        assert env.evaluate()[1] is False
        last, reward, terminated, turns = STRATEGIES[cls](observation, _local(env))
        assert terminated and reward == 1.0, (index, last)
        assert env.evaluate() == (1.0, True)
        assert "\nGame over: " in "\n" + last and ("Congratulations" in last or "cracked the code" in last)
        assert turns <= info["max_turns"]


def test_binary_search_needs_at_most_log2_turns() -> None:
    env = GuessTheNumberEnv()
    for index in range(20):
        observation, _ = env.reset(_task(GuessTheNumberEnv, index, seed=3, max_number=1000))
        _, _, _, turns = play_binary_search(observation, _local(env))
        assert turns <= 10


def test_losing_ends_the_game_with_partial_credit() -> None:
    env = GuessTheNumberEnv()
    env.reset(_task(GuessTheNumberEnv, 0, seed=0, max_turns=1))
    wrong = [number for number in range(1, 21) if number != env.game.game_number]
    # TextArena 0.7.4 checks its turn limit before counting the turn: max_turns=1 allows a second guess
    observation, reward, terminated, _, _ = env.step(f"[{wrong[0]}]")
    assert not terminated and reward == 0.0
    observation, reward, terminated, truncated, _ = env.step(f"[{wrong[1]}]")
    assert terminated and not truncated and "Game over: The turn limit has been reached" in observation
    score, success = env.evaluate()
    assert not success and 0.0 <= score < 1.0 and reward == pytest.approx(score)
    assert env.step("[5]")[0].startswith("The game is over")

    lights = LightsOutEnv()
    lights.reset(_task(LightsOutEnv, 0, seed=0, max_turns=1))
    grid = [row[:] for row in lights.grid()]
    observation, reward, terminated, _, _ = lights.step("[0 0]" if lights_out_presses(grid) != [(0, 0)] else "[1 1]")
    assert terminated and "Game over: Game over! You used all 1 moves" in observation
    assert lights.evaluate()[1] is False


@pytest.mark.parametrize("cls", [GuessTheNumberEnv, MastermindEnv, LightsOutEnv])
def test_reset_is_deterministic_varies_with_the_task_and_leaves_global_random_alone(cls) -> None:
    first, second = cls(), cls()
    random.seed(12345)
    state = random.getstate()
    observations = [first.reset(_task(cls, 4, seed=9)), second.reset(_task(cls, 4, seed=9))]
    assert random.getstate() == state
    assert observations[0] == observations[1]
    secret = _secret(first)
    assert secret == _secret(second)
    secrets = set()
    for seed in range(12):
        first.reset(_task(cls, 4, seed=seed))
        secrets.add(repr(_secret(first)))
    first.reset(_task(cls, 4, seed=9, split="test"))
    secrets.add(repr(_secret(first)))
    assert len(secrets) >= 6


def test_concurrent_resets_draw_the_same_instances_as_serial_ones() -> None:
    tasks = [_task(MastermindEnv, index % 4, seed=index % 4) for index in range(16)]
    expected = {task.index: _secret(_reset(MastermindEnv(), task)) for task in tasks}
    results: list[tuple[int, object]] = []

    def worker(task) -> None:
        for _ in range(5):
            results.append((task.index, _secret(_reset(MastermindEnv(), task))))

    threads = [threading.Thread(target=worker, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 80 and all(secret == expected[index] for index, secret in results)


def _reset(env, task):
    env.reset(task)
    return env


def _secret(env):
    state = env.game.state.game_state
    return state.get("game_number", state.get("secret_code", state.get("grid")))


@pytest.mark.parametrize("cls, action, move", [
    (GuessTheNumberEnv, "7", "[7]"),
    (GuessTheNumberEnv, "  My guess is [12].", "[12]"),
    (GuessTheNumberEnv, "[ 3 ]", "[3]"),
    (MastermindEnv, "1 2 3 4", "[1 2 3 4]"),
    (MastermindEnv, "[4, 3, 2, 1]", "[4 3 2 1]"),
    (MastermindEnv, "I try 5612 now... no: [5 6 1 2]", "[5 6 1 2]"),
    (MastermindEnv, "3456", "[3 4 5 6]"),
    (LightsOutEnv, "[0 2]", "[0 2]"),
    (LightsOutEnv, "(1, 3)", "[1 3]"),
    (LightsOutEnv, "press [4,4] please", "[4 4]"),
    (LightsOutEnv, "2 2", "[2 2]"),
])
def test_moves_are_read_leniently(cls, action: str, move: str) -> None:
    env = cls()
    env.reset(_task(cls, 1, seed=1))
    observation, _, _, _, info = env.step(action)
    assert info["move"] == move and not observation.startswith("Invalid action")


@pytest.mark.parametrize("cls", [GuessTheNumberEnv, MastermindEnv, LightsOutEnv])
def test_text_without_a_move_is_an_observation_and_does_not_touch_the_game(cls) -> None:
    env = cls()
    start = env.reset(_task(cls, 2, seed=2))[1][STATE_KEY]
    before = repr(env.game.state.game_state)
    actions = ["hello", "", "[]", "[1 2]" if cls is not LightsOutEnv else "[1]", "[" + "9" * 5000 + "]",
               "x" * 100_000, "1 2 3 4 5 6 7 8 9 1 2 3"]
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
        assert observation.startswith("Invalid action ") and f"Valid actions: {cls.move_hint}." in observation
        assert (reward, terminated, truncated, info) == (0.0, False, False, {"invalid": True, STATE_KEY: start})
        assert len(observation) < 600
    assert repr(env.game.state.game_state) == before and env.game.state.turn == 0


def _keys(cls, moves: list[str], index: int = 0) -> list[str]:
    """The state key after the reset and after each move of a fresh game of `cls` (task `index`)."""
    env = cls()
    keys = [env.reset(_task(cls, index))[1][STATE_KEY]]
    for move in moves:
        _, _, terminated, _, info = env.step(move)
        assert not terminated, move
        keys.append(info[STATE_KEY])
    return keys


def test_the_state_key_is_the_moves_made_not_their_order_and_a_refused_move_keeps_it() -> None:
    """GiGPO's anchor (#53): GuessTheNumber's and Mastermind's state is the set of guesses made (each hint follows
    from its guess and the secret), LightsOut's the grid (a press undoes itself)."""
    secret = GuessTheNumberEnv.draw_game(_task(GuessTheNumberEnv, 0))[0].game_number
    a, b = [n for n in (3, 4, 5) if n != secret][:2]
    forward = _keys(GuessTheNumberEnv, [f"[{a}]", f"[{b}]", f"[{a}]"])
    backward = _keys(GuessTheNumberEnv, [f"[{b}]", f"[{a}]"])
    assert len(set(forward[:3])) == 3 and forward[2] == backward[2] and forward[3] == forward[2]  # a repeat: refused
    secret = MastermindEnv.draw_game(_task(MastermindEnv, 0))[0].state.game_state["secret_code"]
    codes = [code for code in ("[1 2 3 4]", "[2 3 4 5]", "[3 4 5 6]") if code != f"[{' '.join(map(str, secret))}]"]
    forward, backward = _keys(MastermindEnv, codes[:2]), _keys(MastermindEnv, codes[1::-1])
    assert len(set(forward)) == 3 and forward[2] == backward[2]
    pressed = _keys(LightsOutEnv, ["[0 0]", "[0 0]", "[1 1]"])
    assert pressed[0] == pressed[2] != pressed[1] and pressed[3] not in pressed[:3]


def test_illegal_moves_are_judged_by_the_game_rules() -> None:
    env = GuessTheNumberEnv()
    env.reset(_task(GuessTheNumberEnv, 0, seed=0))
    observation, reward, terminated, _, _ = env.step("[99]")  # out of 1..20: TextArena's first warning
    assert "invalid move" in observation and "outside the range" in observation and not terminated
    observation, reward, terminated, _, info = env.step("[0]")  # a second one in a row ends the game
    assert terminated and info["invalid_move"] and "Game over: Invalid Move" in observation
    assert env.evaluate()[1] is False


@pytest.mark.parametrize("cls, params, field, valid", [
    (GuessTheNumberEnv, {"max_number": 5}, "params.max_number=5", "from 10 to 1000"),
    (GuessTheNumberEnv, {"max_turns": 0}, "params.max_turns=0", "from 1 to 50"),
    (MastermindEnv, {"code_length": 7}, "params.code_length=7", "from 2 to 6"),
    (MastermindEnv, {"code_length": 5, "num_numbers": 4}, "params.num_numbers=4", "from 5 to 9"),
    (LightsOutEnv, {"size": 2}, "params.size=2", "from 3 to 8"),
    (LightsOutEnv, {"max_turns": 101}, "params.max_turns=101", "from 1 to 100"),
])
def test_bad_params_are_clear_errors(cls, params: dict, field: str, valid: str) -> None:
    with pytest.raises(EnvServiceError) as failure:
        cls.resolve_task(0, "train", 0, params)
    assert failure.value.code == ErrorCode.bad_request
    assert field in failure.value.message and valid in failure.value.message
    with pytest.raises(EnvServiceError) as failure:
        cls.resolve_task(0, "train", 0, {"no_such_option": 1})
    assert failure.value.code == ErrorCode.bad_request
    assert cls.task_counts() == {"train": 1000, "test": 200}


def test_games_won_over_http_through_a_real_service(tmp_path) -> None:
    with EnvServiceProcess(sorted(ENV_IDS), log_path=tmp_path / "service.log", startup_timeout_s=60,
                           env={"ENVSERVICE_TOKEN": ""}) as service:
        assert sorted(service.envs) == sorted(ENV_IDS)
        with EnvClient(service.url, timeout=10) as client:
            for env_id, cls in ENV_IDS.items():
                created = client.create(env_id, task_id=7, split="test", seed=21)

                def step(action: str, session_id: str = created.session_id) -> tuple[str, float, bool]:
                    response = client.step(session_id, action)
                    assert not response.truncated
                    return response.observation, response.reward, response.terminated

                invalid = step("what now?")
                assert invalid[0].startswith("Invalid action 'what now?'") and not invalid[2]
                _, reward, terminated, _ = STRATEGIES[cls](created.observation, step)
                assert terminated and reward == 1.0, env_id
                evaluation = client.evaluate(created.session_id)
                assert evaluation.success and evaluation.score == 1.0
                assert client.release(created.session_id).released
            with pytest.raises(EnvServiceError) as failure:
                client.create("textarena-lights-out", params={"size": 99})
            assert failure.value.code == ErrorCode.bad_request and "params.size=99" in failure.value.message
