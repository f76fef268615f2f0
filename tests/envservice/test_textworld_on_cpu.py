"""TextWorld through envservice: generated games are cached per (split, index, size), deterministic, and their
walkthrough wins; bad size params are refused by name; `check_env` passes."""

from __future__ import annotations

import time

import pytest

import envservice
from envservice.envs.base import STATE_KEY
from envservice.envs.textworld_env import CACHE_ENV, TextWorldEnv, clean_text, game_path
from envservice.errors import EnvServiceError

pytestmark = pytest.mark.startup  # TextWorld compiles each game (tw-make, Inform 7): the full run only


@pytest.fixture(autouse=True)
def game_cache(tmp_path_factory, monkeypatch):
    """Compiled games go to a folder shared by this module's tests (not the user's cache)."""
    folder = tmp_path_factory.getbasetemp() / "textworld-cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def _task(index: int, split: str = "train", **params):
    return TextWorldEnv.resolve_task(index, split, 0, params)


@pytest.mark.timeout(120)
def test_the_state_key_is_the_game_s_facts_not_the_feedback() -> None:
    """#53: commands that change nothing ("look", an unknown verb, text that cannot be sent) keep the key while
    their answers differ; the walkthrough's first command changes it."""
    env = TextWorldEnv()
    _, info = env.reset(_task(0))
    start = info[STATE_KEY]
    answers = [env.step(action) for action in ("look", "xyzzy", "\ud800")]
    assert [answer[4][STATE_KEY] for answer in answers] == [start] * 3
    assert len({answer[0] for answer in answers}) == 3
    assert env.step(env.gold_actions()[0])[4][STATE_KEY] != start
    env.close()


@pytest.mark.timeout(120)
def test_walkthrough_wins_through_the_service(make_client) -> None:
    client = make_client(env_ids=["textworld"])
    for split, index in (("train", 0), ("train", 1), ("test", 0)):
        oracle = TextWorldEnv()
        oracle.reset(_task(index, split))
        actions = oracle.gold_actions()
        oracle.close()
        created = client.post("/create", json={"env_id": "textworld", "task_id": index, "split": split, "seed": 0})
        assert created.status_code == 200, created.text
        session_id = created.json()["session_id"]
        assert not created.json()["observation"].startswith(" ")  # the ASCII banner is gone
        for action in actions:
            step = client.post("/step", json={"session_id": session_id, "action": action}).json()
        assert step["terminated"] and step["reward"] > 0 and "*** The End ***" in step["observation"]
        assert client.post("/evaluate", json={"session_id": session_id}).json()["success"] is True
        client.post("/release", json={"session_id": session_id})


@pytest.mark.timeout(120)
def test_games_are_cached_deterministic_and_split_apart(game_cache, monkeypatch, tmp_path) -> None:
    env = TextWorldEnv()
    first, info = env.reset(_task(5))
    path = game_path(_task(5))
    assert path.is_file() and path.parent.parent == game_cache and path.name == "train-5-r3-o6-q3.z8"
    mtime, start = path.stat().st_mtime_ns, time.perf_counter()
    assert env.reset(_task(5))[0] == first
    assert time.perf_counter() - start < 1.0 and path.stat().st_mtime_ns == mtime  # loaded, not regenerated
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh"))
    assert TextWorldEnv().reset(_task(5))[0] == first  # regenerated from the same seed: the same game
    assert env.reset(_task(5, "test"))[0] != first
    assert env.reset(_task(5, rooms=6, quest_length=5))[1]["objective"] != info["objective"]
    env.close()


def test_bad_size_param_names_the_param_and_range() -> None:
    with pytest.raises(EnvServiceError, match=r"params.rooms=0 is invalid: give an integer in 1..20"):
        TextWorldEnv().reset(_task(0, rooms=0))
    with pytest.raises(EnvServiceError, match=r"params.quest_length='3' must be a JSON integer, not a string"):
        TextWorldEnv().reset(_task(0, quest_length="3"))
    with pytest.raises(EnvServiceError, match=r"unknown name\(s\) \['size'\]"):
        _task(0, size=3)


def test_clean_text_drops_banner_and_prompt() -> None:
    raw = "\n\n   ____  \n  | $$ \\ \n\nWelcome! Do it.\n\n-= Room =-\nA room.\n>  -= Room =-0/1"
    assert clean_text(raw) == "Welcome! Do it.\n\n-= Room =-\nA room."


@pytest.mark.timeout(120)
def test_check_env_passes() -> None:
    # 20 tasks per split for split_disjoint: a fingerprint generates the game (~50 ms, ~5 draws per test task),
    # so the default 200 would add ~50 s
    assert "reset_deterministic" in envservice.check_env("textworld", split_samples=20)


@pytest.mark.timeout(240)
def test_games_made_and_played_at_once_in_threads_all_work(monkeypatch, tmp_path, play_in_threads) -> None:
    """The service runs each session's calls in a thread of its own, and TextWorld parses with one parser per
    process: before #69 sessions created at once failed in reset (a parse error, an IndexError, a TypeError; found
    by `python -m envservice.check --hacks textworld`). Three games made at once from an empty cache, then played
    by four threads."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty-cache"))
    tasks = [_task(10 + index % 3) for index in range(8)]
    outcomes = play_in_threads(TextWorldEnv, tasks, ("look", "inventory", "go north"))
    assert outcomes == ["ok"] * 8, next(outcome for outcome in outcomes if outcome != "ok")
