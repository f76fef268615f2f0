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
    assert report == {"tasks": 1, "distinct": 1, "shared": {"seen": 1}, "shared_any": 1}
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
