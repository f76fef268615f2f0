"""Two-player TicTacToe (envservice/envs/two_player.py): seats and zero-sum outcomes by hand, the scripted opponents
(the perfect one never loses), starting positions split by content up to the board's symmetries, invalid actions and
params, and a self-play game through a real service over loopback."""

from __future__ import annotations

import random

import pytest

from envservice.check import check_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY
from envservice.envs.two_player import (SEAT, SEAT_REWARDS, TicTacToeEnv, canonical, free_cells, minimax_value,
                                        perfect_move)
from envservice.errors import EnvServiceError
from envservice.server import EnvServiceConfig, create_app

pytestmark = pytest.mark.timeout(120)


def _task(index: int, split: str = "train", seed: int = 0, **params):
    return TicTacToeEnv.resolve_task(index, split, seed, params)


def _started(**params) -> tuple[TicTacToeEnv, dict]:
    """An env reset on the empty board (no opening)."""
    env = TicTacToeEnv()
    _, info = env.reset(_task(0, opening_moves=0, **params))
    return env, info


def test_seats_alternate_and_the_outcome_is_zero_sum():
    """Self-play from the empty board: player 0 (O) opens; the answer names the seat to move and shows its view;
    player 1 (X) wins on the diagonal 0-4-8: seat rewards {0: -1, 1: 1}, the step's reward is the mover's."""
    env, info = _started(opponent="none")
    assert info[SEAT] == 0 and info["opponent"] == "none"
    seats = []
    for cell in (1, 0, 2, 4, 7):
        observation, reward, terminated, _, info = env.step(f"[{cell}]")
        assert (reward, terminated) == (0.0, False) and f"placed their symbol" in observation
        seats.append(info[SEAT])
    assert seats == [1, 0, 1, 0, 1]
    observation, reward, terminated, _, info = env.step("I take [8]")
    assert terminated and reward == 1.0 and info[SEAT_REWARDS] == {"0": -1.0, "1": 1.0} and SEAT not in info
    assert observation.endswith("Game over: Player 1 has won!")
    assert env.board() == ("X", "O", "O", "", "X", "", "", "O", "X")
    assert env.evaluate() == (0.0, False)  # seat 0 lost
    assert env.step("[3]")[2:4] == (True, False)  # over: nothing more is played


def test_a_draw_gives_both_seats_zero():
    env, _ = _started(opponent="none")
    for cell in (0, 4, 8, 2, 6, 3, 5, 7):
        assert not env.step(f"[{cell}]")[2]
    _, reward, terminated, _, info = env.step("[1]")
    assert terminated and reward == 0.0 and info[SEAT_REWARDS] == {"0": 0.0, "1": 0.0}
    assert env.evaluate() == (0.5, False)


def test_text_without_a_cell_and_an_occupied_cell_are_the_games_rule_and_an_unended_game_scores_zero():
    """An answer with no cell and an occupied cell are both TextArena's invalid move: a warning (the same seat moves
    again, the state key unchanged), and a second refusal in a row loses the game for that seat. An unended game
    scores 0 (a draw's 0.5 paid stalling, module docstring). The compact view names the refusal's reason."""
    env, info = _started(opponent="none")
    env.step("[4]")
    before = env.state_key
    assert env.evaluate() == (0.0, False)  # not ended: no result
    observation, reward, terminated, _, info = env.step("the middle one")
    assert "Player 1 attempted an invalid move. Reason: The submitted move does not follow the correct format." \
        in observation
    assert (reward, terminated, info[SEAT], info[STATE_KEY], info["invalid"]) == (0.0, False, 1, before, True)
    env.step("[0]")  # a valid move clears the warning
    observation, _, terminated, _, info = env.step("[4]")
    assert not terminated and info[SEAT] == 0 and "cell 4 is already occupied" in observation and info["invalid"]
    _, reward, terminated, _, info = env.step("my move is the corner")
    assert terminated and reward == -1.0 and info[SEAT_REWARDS] == {"0": -1.0, "1": 1.0} and info["invalid_move"]
    assert env.evaluate() == (0.0, False)

    compact, _ = _started(opponent="none", view="compact")
    compact.step("[4]")
    observation = compact.step("hmm")[0]
    assert "Your last answer was refused: it named no free cell. Once more and you lose." in observation
    compact.step("[0]")
    assert "Your last answer was refused: that cell is taken. Once more and you lose." in compact.step("[0]")[0]


def test_the_first_and_random_opponents_answer_inside_the_step():
    """Against `first`, the client (seat 0, to move on the empty board) sees only its own turns: after its [4],
    the opponent took cell 0, the lowest free one. `random` replays the same cells for the same task."""
    env, info = _started(opponent="first")
    _, _, _, _, info = env.step("[4]")
    assert info[SEAT] == 0 and env.board() == ("X", "", "", "", "O", "", "", "", "")
    games = []
    for _ in range(2):
        env, _ = _started(opponent="random")
        for cell in (4, 0, 2, 6, 8, 1, 3, 5, 7):
            if cell in free_cells(env.board()) and not env.game.state.done:
                env.step(f"[{cell}]")
        games.append(env.board())
    assert games[0] == games[1]


def test_minimax_by_hand_and_the_perfect_opponent_never_loses():
    """Values by hand: the empty board is a draw; X with two in a row and the move wins; O to move facing two open
    X lines loses. Then 200 games of random moves against `perfect` from train positions (a random opening may be
    lost already): the client never does better than the starting position's value."""
    assert minimax_value(("",) * 9, "O") == 0
    assert minimax_value(("X", "X", "", "O", "O", "", "", "", ""), "X") == 1
    assert minimax_value(("X", "X", "", "", "", "", "O", "O", "X"), "O") == -1  # X threatens cells 2 and 4
    fork = ("X", "", "", "", "O", "", "", "", "X")  # O to move must not take a corner
    assert perfect_move(fork, "O") in (1, 3, 5, 7)
    rng, beaten = random.Random(0), []
    env = TicTacToeEnv()
    for index in range(200):
        env.reset(_task(index, opponent="perfect"))
        seat = env.seat_to_move()
        value = minimax_value(env.board(), "X" if seat == 1 else "O")  # the client's best from the start
        while True:
            _, _, terminated, _, info = env.step(f"[{rng.choice(free_cells(env.board()))}]")
            if terminated:
                beaten.append(info[SEAT_REWARDS][str(seat)] - value)
                break
    assert max(beaten) <= 0 and min(beaten) < 0  # never more than the position allows; often less


def test_positions_are_split_by_content_up_to_turning_and_mirroring():
    board = ("X", "", "", "", "O", "", "", "", "")
    images = {canonical(tuple(board[i] for i in p)) for p in ((6, 3, 0, 7, 4, 1, 8, 5, 2), (2, 1, 0, 5, 4, 3, 8, 7, 6))}
    assert images == {canonical(board)}
    for moves in (2, 3, 4):
        prints = {split: {TicTacToeEnv.task_fingerprint(_task(i, split, opening_moves=moves)) for i in range(200)}
                  for split in ("train", "test")}
        assert prints["train"] and prints["test"] and not prints["train"] & prints["test"], moves
    env = TicTacToeEnv()
    observation, info = env.reset(_task(5, "test"))
    assert sum(1 for mark in env.board() if mark) == 3 and info[SEAT] == 1 and "Current Board" in observation
    assert env.reset(_task(5, "test"))[1][STATE_KEY] == info[STATE_KEY]


def test_the_compact_view_shows_the_mark_the_opponents_move_the_board_and_the_free_cells():
    env, _ = _started(opponent="none", view="compact")
    assert env.reset(_task(0, opening_moves=0, opponent="none", view="compact"))[0] == (
        "You are O.\nBoard (cells 0-8, row by row):\n...\n...\n...\n"
        "Free cells: 0 1 2 3 4 5 6 7 8. Answer with one, e.g. [0].")
    assert env.step("[4]")[0] == ("You are X. The opponent took cell 4.\nBoard (cells 0-8, row by row):\n...\n.O.\n...\n"
                                  "Free cells: 0 1 2 3 5 6 7 8. Answer with one, e.g. [0].")
    refused = env.step("[4]")[0]
    assert refused.splitlines()[1] == "Your last answer was refused: that cell is taken. Once more and you lose."
    for cell in (0, 1, 3, 2):
        env.step(f"[{cell}]")
    observation, reward, terminated, _, _ = env.step("[6]")  # X: 0, 3, 6
    assert terminated and reward == 1.0 and observation == (
        "You are X. The opponent took cell 2.\nBoard (cells 0-8, row by row):\nXOO\nXO.\nX..\n"
        "Free cells: 5 7 8. Answer with one, e.g. [5].\nGame over: Player 1 has won!")


@pytest.mark.parametrize("params, says", [
    ({"opponent": "grandmaster"}, "params.opponent='grandmaster' is not an opponent; valid choices: ['none', 'random'"),
    ({"opening_moves": 5}, "params.opening_moves=5 must be an integer from 0 to 4"),
    ({"view": "pretty"}, "params.view='pretty' is not a view; valid choices: ['textarena', 'compact']"),
    ({"opening_moves": True}, "params.opening_moves=True must be a JSON integer, not a boolean"),
])
def test_bad_params_name_the_field_and_the_choices(params, says):
    with pytest.raises(EnvServiceError) as failure:
        _task(0, **params)
    assert says in str(failure.value)


def test_check_env_passes():
    assert "garbage_actions" in check_env("tictactoe")


def test_a_self_play_game_over_the_service(serve_app):
    """Both seats through one session of a real service: each answer names the next seat."""
    app = create_app(EnvServiceConfig(env_ids=["tictactoe"], max_sessions=4))
    with serve_app(app) as url, EnvClient(url) as client:
        created = client.create("tictactoe", task_id=0, params={"opponent": "none", "opening_moves": 0})
        assert created.info[SEAT] == 0
        for cell in (0, 3, 1, 4):
            step = client.step(created.session_id, f"[{cell}]")
            assert not step.terminated
        step = client.step(created.session_id, "[2]")
        assert step.terminated and step.reward == 1.0 and step.info[SEAT_REWARDS] == {"0": 1.0, "1": -1.0}
        evaluation = client.evaluate(created.session_id)
        assert (evaluation.score, evaluation.success) == (1.0, True)
        client.release(created.session_id)
