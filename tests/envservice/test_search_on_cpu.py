"""Search QA through envservice: two searches find both hops and the exact answer wins; the knowledge base is
deterministic; wrong answers, bad actions and bad params are handled; `check_env` passes."""

from __future__ import annotations

import pytest

import envservice
from envservice.envs import search
from envservice.envs.base import STATE_KEY
from envservice.envs.search import Retriever, SearchQAEnv, knowledge_base, normalize_answer, split_questions
from envservice.errors import EnvServiceError


def _task(index: int, split: str = "train", **params):
    return SearchQAEnv.resolve_task(index, split, 0, params)


def test_gold_path_through_the_service(make_client) -> None:
    client = make_client(env_ids=["search"])
    for split, index in (("train", 0), ("train", 1000), ("test", 5)):
        created = client.post("/create", json={"env_id": "search", "task_id": index, "split": split, "seed": 0,
                                               "params": {"top_k": 3}})
        assert created.status_code == 200, created.text
        session_id = created.json()["session_id"]
        question = split_questions(split)[index]
        assert created.json()["observation"].startswith(f"Question: {question.text}\n")
        first, second = question.hops
        hop1 = client.post("/step", json={"session_id": session_id, "action": f"search[{first}]"}).json()
        assert hop1["reward"] == 0.0 and second in hop1["observation"]  # the bridge entity is found
        hop2 = client.post("/step", json={"session_id": session_id, "action": f"search[{second}]"}).json()
        assert question.answer in hop2["observation"] and hop2["observation"].count("\n[") <= 2
        answer = client.post("/step", json={"session_id": session_id, "action": f"answer[ {question.answer.upper()}. ]"})
        assert answer.json()["terminated"] and answer.json()["reward"] == 1.0
        assert client.post("/evaluate", json={"session_id": session_id}).json() == {"score": 1.0, "success": True}


def test_gold_actions_solve_every_tenth_question() -> None:
    env = SearchQAEnv()
    for split in ("train", "test"):
        for index in range(0, len(SearchQAEnv.splits[split]), 10):
            env.reset(_task(index, split))
            for action in env.gold_actions():
                observation, reward, terminated, _, _ = env.step(action)
            assert terminated and reward == 1.0, (split, index, observation)


def test_wrong_answer_ends_without_reward_and_invalid_action_is_explained() -> None:
    env = SearchQAEnv()
    env.reset(_task(3))
    observation, reward, terminated, truncated, info = env.step("look around")
    assert observation == "Invalid action 'look around'. " + search.ACTION_HELP and not terminated and info["invalid"]
    assert env.step("search[qqqq zzzz]")[0] == "No passage matches 'qqqq zzzz'."
    observation, reward, terminated, truncated, info = env.step("answer[Atlantis]")
    assert (observation, reward, terminated, truncated) == ("Your answer 'Atlantis' is incorrect.", 0.0, True, False)
    assert info["correct"] is False
    assert env.evaluate() == (0.0, False)


def test_the_state_key_is_the_question_and_the_passages_found_in_any_order() -> None:
    """GiGPO's anchor (#53): what the agent knows when it acts next. A refused action, a search that finds nothing
    and a search that finds the same passages in other words keep it; both hops found in either order reach one
    key; another question starts from another key."""
    env, other = SearchQAEnv(), SearchQAEnv()
    task = _task(7)
    start = env.reset(task)[1][STATE_KEY]
    assert other.reset(task)[1][STATE_KEY] == start
    assert other.reset(_task(8))[1][STATE_KEY] != start
    other.reset(task)
    assert env.step("look around")[4][STATE_KEY] == start
    assert env.step("search[qqqq zzzz]")[4][STATE_KEY] == start
    first, second = split_questions("train")[7].hops
    one_hop = env.step(f"search[{first}]")[4][STATE_KEY]
    assert one_hop != start and env.step(f"search[  {first.upper()} ]")[4][STATE_KEY] == one_hop
    both = env.step(f"search[{second}]")[4][STATE_KEY]
    assert both not in (start, one_hop)
    assert other.step(f"search[{second}]")[4][STATE_KEY] not in (start, one_hop, both)
    assert other.step(f"search[{first}]")[4][STATE_KEY] == both


def test_knowledge_base_is_deterministic_and_splits_are_disjoint() -> None:
    kb = knowledge_base()
    knowledge_base.cache_clear()
    assert knowledge_base() == kb
    assert len(kb.passages) == sum(search.COUNTS.values()) == len({title for title, _ in kb.passages})
    train, test = split_questions("train"), split_questions("test")
    assert not {q.text for q in train} & {q.text for q in test}
    assert SearchQAEnv.task_counts() == {"train": len(train), "test": len(test)} == {"train": 1890, "test": 210}
    assert Retriever.shared() is Retriever.shared()


def test_top_k_param_and_answer_normalisation() -> None:
    env = SearchQAEnv()
    env.reset(_task(0, top_k=1))
    assert env.step(env.gold_actions()[0])[0].count("\n") == 0
    with pytest.raises(EnvServiceError, match=r"params.top_k=0 is invalid: give an integer in 1..10"):
        env.reset(_task(0, top_k=0))
    assert normalize_answer("  The  Kalo-Labs! ") == "kalolabs"


@pytest.mark.timeout(60)
def test_check_env_passes() -> None:
    assert "step_types" in envservice.check_env("search")
