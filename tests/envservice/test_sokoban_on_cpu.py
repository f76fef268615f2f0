"""Sokoban (envservice/envs/sokoban.py): the service contract, the generator's solutions as an oracle on many
rooms, the push rules and rewards on a hand-made room, invalid actions and params, and a game over HTTP."""

from __future__ import annotations

import pytest

from envservice import registry
from envservice.check import check_env
from envservice.client import EnvClient
from envservice.envs.base import STATE_KEY
from envservice.envs.sokoban import ACTIONS, SokobanEnv, generate_room, max_boxes, Room
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess
from envservice.protocol import ErrorCode

pytestmark = pytest.mark.timeout(120)


def _task(index: int, seed: int = 0, split: str = "train", **params):
    return SokobanEnv.resolve_task(index, split, seed, params)


def _play(env: SokobanEnv, actions: list[str]) -> tuple[float, bool, int]:
    """Play `actions` until the episode ends; (total reward, terminated, steps taken)."""
    total, terminated, steps = 0.0, False, 0
    for action in actions:
        _, reward, terminated, truncated, _ = env.step(action)
        total, steps = total + reward, steps + 1
        assert not truncated
        if terminated:
            break
    return total, terminated, steps


def _room_from_text(text: str) -> Room:
    """A hand-made room: '#' wall, '_' floor, 'O' target, 'X' box, '*' box on target, 'P' player, 'S' player on
    target."""
    rows = text.strip().splitlines()
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    return Room(walls=frozenset(cell for cell, ch in cells.items() if ch == "#"),
                targets=tuple(sorted(cell for cell, ch in cells.items() if ch in "O*S")),
                boxes=tuple(sorted(cell for cell, ch in cells.items() if ch in "X*")),
                player=next(cell for cell, ch in cells.items() if ch in "PS"), size=len(rows), solution=[])


def _env_with_room(text: str) -> SokobanEnv:
    env = SokobanEnv()
    env.reset(_task(0))
    env.room = _room_from_text(text)
    env._boxes, env._player = set(env.room.boxes), env.room.player
    return env


def test_check_env_passes() -> None:
    assert "reset_deterministic" in check_env("sokoban")
    assert registry.get("sokoban").origin.startswith("plugin")


@pytest.mark.parametrize("size", [5, 6, 7, 9, 12])
def test_generator_solution_solves_many_rooms(size: int) -> None:
    env = SokobanEnv()
    for boxes in sorted({1, max_boxes(size)}):
        for index in range(25):
            split = "train" if index % 2 else "test"
            observation, info = env.reset(_task(index, seed=index * 31 + size, split=split, size=size, boxes=boxes))
            start = f"player {env.room.player} boxes {sorted(env.room.boxes)}"
            assert info == {"size": size, "boxes": boxes, STATE_KEY: start}
            assert env.evaluate()[1] is False and observation.count("\n") >= size
            total, terminated, steps = _play(env, list(env.solution))
            assert terminated, (size, boxes, index)
            assert env.evaluate() == (1.0, True)
            # every step costs 0.1; each box ends on a target (+1 net per box) and solving adds +10
            assert total == pytest.approx(-0.1 * steps + boxes + 10.0), (size, boxes, index)


def test_rooms_are_deterministic_and_differ_by_seed_index_and_split() -> None:
    first, second = generate_room(_task(3, seed=7)), generate_room(_task(3, seed=7))
    assert first == second
    env_a, env_b = SokobanEnv(), SokobanEnv()
    assert env_a.reset(_task(3, seed=7))[0] == env_b.reset(_task(3, seed=7))[0]
    assert env_a.solution == env_b.solution == first.solution
    others = [generate_room(_task(3, seed=8)), generate_room(_task(4, seed=7)),
              generate_room(_task(3, seed=7, split="test"))]
    assert all(other != first for other in others)
    layouts = {(room.walls, room.boxes, room.targets) for room in (generate_room(_task(i)) for i in range(30))}
    assert len(layouts) == 30


def test_generated_rooms_start_unsolved_with_boxes_off_target() -> None:
    for index in range(20):
        room = generate_room(_task(index, size=8, boxes=3))
        assert len(room.targets) == len(room.boxes) == 3
        assert any(box not in room.targets for box in room.boxes)
        assert room.player not in room.boxes and room.player not in room.walls
        assert 0 < len(room.solution) and set(room.solution) <= set(ACTIONS)


def test_push_rules_rewards_and_solving_on_a_hand_made_room() -> None:
    env = _env_with_room("""
######
#P_XO#
#__X_#
#__O_#
#____#
######
""")
    assert env.render().splitlines()[1] == "#P_XO#"
    observation, reward, terminated, _, _ = env.step("up")
    assert observation.startswith("You bump into a wall (up).") and reward == pytest.approx(-0.1) and not terminated
    observation, reward, _, _, _ = env.step("right")
    assert observation.startswith("You move right.") and reward == pytest.approx(-0.1)
    observation, reward, terminated, _, _ = env.step("right")  # box (1, 3) onto the target (1, 4)
    assert observation.startswith("You push a box right onto a target.") and reward == pytest.approx(0.9)
    assert "#__P*#" in observation and "Boxes on targets: 1/2." in observation and not terminated
    assert env.evaluate() == (0.5, False)
    observation, reward, _, _, _ = env.step("right")  # the box is against the wall: nothing moves
    assert observation.startswith("The box cannot move right") and reward == pytest.approx(-0.1)
    assert "#__P*#" in observation
    observation, reward, terminated, truncated, _ = env.step("down")  # box (2, 3) onto the last target (3, 3)
    assert terminated and not truncated and reward == pytest.approx(-0.1 + 1.0 + 10.0)
    assert "puzzle solved" in observation and "Boxes on targets: 2/2." in observation
    assert env.evaluate() == (1.0, True)


def test_pushing_a_box_off_its_target_costs_and_player_on_target_is_shown() -> None:
    env = _env_with_room("""
#####
#_*_#
#_P_#
#___#
#####
""")
    assert env.evaluate() == (1.0, True)
    env.step("left")
    env.step("up")
    observation, reward, terminated, _, _ = env.step("right")  # box (1, 2) -> (1, 3), player onto the target
    assert observation.startswith("You push a box right off its target.")
    assert reward == pytest.approx(-1.1) and not terminated
    assert env.render().splitlines()[1] == "#_SX#" and env.evaluate() == (0.0, False)
    observation, reward, _, _, _ = env.step("down")
    assert env.render().splitlines()[1] == "#_OX#" and reward == pytest.approx(-0.1)


def test_actions_are_lenient_and_invalid_ones_are_observations() -> None:
    env = SokobanEnv()
    first, start = env.reset(_task(0))
    before, start_key = env.render(), start[STATE_KEY]
    for action in ["jump", "", "north", "up up", "x" * 100_000]:
        observation, reward, terminated, truncated, info = env.step(action)
        assert observation.startswith("Invalid action ") and observation.endswith(
            "Valid actions: up, down, left, right.")
        assert (reward, terminated, truncated, info) == (0.0, False, False, {"invalid": True, STATE_KEY: start_key})
        assert len(observation) < 500 and env.render() == before
    for action in ["  UP ", "[left]", "Right.", "DOWN\n"]:
        observation, _, _, _, info = env.step(action)
        assert not observation.startswith("Invalid action") and set(info) == {STATE_KEY}


@pytest.mark.parametrize("params, field, valid", [
    ({"size": 4}, "params.size=4", "from 5 to 12"),
    ({"size": 13}, "params.size=13", "from 5 to 12"),
    ({"boxes": 0}, "params.boxes=0", "from 1 to 4 for size 7"),
    ({"size": 5, "boxes": 2}, "params.boxes=2", "from 1 to 1 for size 5"),
    ({"size": 12, "boxes": 6}, "params.boxes=6", "from 1 to 5 for size 12"),
])
def test_bad_params_are_clear_errors(params: dict, field: str, valid: str) -> None:
    with pytest.raises(EnvServiceError) as failure:
        SokobanEnv.resolve_task(0, "train", 0, params)
    assert failure.value.code == ErrorCode.bad_request
    assert field in failure.value.message and valid in failure.value.message


def test_bad_param_types_and_names_are_rejected() -> None:
    for params in ({"size": "7"}, {"boxes": True}, {"walls": 3}):
        with pytest.raises(EnvServiceError) as failure:
            SokobanEnv.resolve_task(0, "train", 0, params)
        assert failure.value.code == ErrorCode.bad_request
    assert SokobanEnv.task_counts() == {"train": 1000, "test": 200}


def test_solution_over_http_through_a_real_service(tmp_path) -> None:
    params = {"size": 8, "boxes": 3}
    room = generate_room(_task(11, seed=5, split="test", **params))  # same task and seed: the service's room
    on_targets = sum(box in room.targets for box in room.boxes)
    with EnvServiceProcess(["sokoban"], log_path=tmp_path / "service.log", startup_timeout_s=60,
                           env={"ENVSERVICE_TOKEN": ""}) as service:
        with EnvClient(service.url, timeout=10) as client:
            created = client.create("sokoban", task_id="room-11", split="test", seed=5, params=params)
            assert f"Boxes on targets: {on_targets}/3." in created.observation and on_targets < 3
            invalid = client.step(created.session_id, "teleport")
            assert invalid.observation.startswith("Invalid action 'teleport'") and not invalid.terminated
            for action in room.solution:
                step = client.step(created.session_id, action)
                if step.terminated:
                    break
            assert step.terminated and not step.truncated and step.reward > 10
            evaluation = client.evaluate(created.session_id)
            assert evaluation.success and evaluation.score == 1.0
            with pytest.raises(EnvServiceError) as failure:
                client.create("sokoban", params={"size": 20})
            assert failure.value.code == ErrorCode.bad_request and "params.size=20" in failure.value.message
