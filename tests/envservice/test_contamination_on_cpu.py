"""`envservice.contamination`: evaluated tasks are compared with trained ones by content, never by label."""

from __future__ import annotations

import pytest

from envservice.contamination import TaskSet, UnknownContent, contamination, fingerprints


def test_contamination_counts_content_not_labels() -> None:
    """Two train maps with other indices but the same layout count as the same task; a test map never does."""
    first = fingerprints(TaskSet.of("a", "frozenlake", "train", range(1000)))
    twins = [(i, j) for i, fp in enumerate(first) for j in range(i) if first[j] == fp][:1]
    assert twins, "4x4 train maps repeat (499 distinct of 1000)"
    later, earlier = twins[0]
    report = contamination(TaskSet.of("eval", "frozenlake", "train", [later]),
                           [TaskSet.of("seen", "frozenlake", "train", [earlier])])
    assert report == {"tasks": 1, "distinct": 1, "shared": {"seen": 1}, "shared_any": 1, "folds": {"frozenlake": []}}
    unseen = contamination(TaskSet.of("eval", "frozenlake", "test", range(200)),
                           [TaskSet.of("train", "frozenlake", "train", range(1000))])
    assert unseen["shared_any"] == 0 and unseen["distinct"] == 200


def test_an_env_without_fingerprints_cannot_have_a_held_out_set(test_envs) -> None:
    with pytest.raises(UnknownContent, match="gives no task_fingerprint.*do not call it held-out"):
        fingerprints(TaskSet.of("val", "counting", next(iter(test_envs["counting"].splits)), [0]))


def test_the_data_writer_says_whether_validation_rows_are_held_out(test_envs) -> None:
    from beyond_agent.data import validation_overlap

    assert validation_overlap("frozenlake", list(range(480)), list(range(64)), 0, "test", {"around": True}) == (
        "0 of 64 validation rows have the content of a train row (64 distinct): held-out")
    on_train = validation_overlap("frozenlake", list(range(480)), list(range(500, 564)), 0, "train", None)
    assert on_train.endswith("NOT held-out") and not on_train.startswith("0 of")
    assert validation_overlap("counting", [0], [0], 0, next(iter(test_envs["counting"].splits)), None).startswith(
        "validation rows not checked against the train rows: env 'counting' gives no task_fingerprint")


LEVEL = "BabyAI-GoToRedBallNoDists-v0"


def test_rows_of_one_named_task_differ_by_their_seeds_and_the_test_split_is_checked_by_layout(serve_app, tmp_path):
    """`data --task NAME`: every row plays that BabyAI level, the task numbers pick the seeds (the layouts); the
    test split's layouts are none of the train rows' (the level's name alone would say every row is the same)."""
    import pandas as pd

    from beyond_agent.data import validation_overlap, write_task_files
    from envservice.server import EnvServiceConfig, create_app

    with serve_app(create_app(EnvServiceConfig(env_ids=["babyai"]))) as url:
        train, _ = write_task_files("babyai", tmp_path, [0, 1, 2], [0], seed=10, envservice_url=url, task_name=LEVEL)
    rows = pd.read_parquet(train)
    assert [(info["task_id"], info["seed"]) for info in rows["extra_info"]] == [(LEVEL, 10), (LEVEL, 11), (LEVEL, 12)]
    assert all(prompt[0]["content"].startswith("Mission: go to the red ball.") for prompt in rows["prompt"])
    layouts = fingerprints(TaskSet("rows", "babyai", "train", ((LEVEL, 10), (LEVEL, 11), (LEVEL, 12))))
    assert len(set(layouts)) == 3  # three layouts (a first view may still look alike: the ball out of sight)
    # 13 distinct: the level has about 34 test layouts up to the room's rotations and mirror images, so 16 repeat some
    assert validation_overlap("babyai", list(range(64)), list(range(16)), 0, "test", None, LEVEL) == (
        "0 of 16 validation rows have the content of a train row (13 distinct): held-out")
    assert validation_overlap("babyai", list(range(64)), list(range(16)), 0, "train", None, LEVEL).startswith(
        "16 of 16 validation rows")


def test_the_report_says_what_each_env_fingerprint_folds() -> None:
    """A count of shared tasks means what the fingerprint calls one task: the report names the symmetries it folds
    (BabyAI: the room's rotations and mirror images; FrozenLake: none)."""
    from envservice.envs.babyai import BabyAIEnv

    report = contamination(TaskSet.of("eval", "babyai", "test", range(8), task_name=LEVEL),
                           [TaskSet.of("train", "babyai", "train", range(64), task_name=LEVEL)])
    assert report["shared_any"] == 0 and report["folds"] == {"babyai": list(BabyAIEnv.fingerprint_folds)}
    assert any("rotations" in fold for fold in report["folds"]["babyai"])
