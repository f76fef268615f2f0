"""The trajectory dump's schema: what a finished episode becomes, atomic writes, and named format errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.handler import Episode
from beyond_agent.trajectories import (SCHEMA_VERSION, TrajectoryFormatError, TrajectoryRecord, episode_record,
                                              parse_dump_file_name, read_dump, write_dump)


def finished_episode() -> EpisodeResult:
    episode = Episode(prompt_ids=[1, 2, 3], response_ids=[10, 11, 12, 13, 14], response_mask=[1, 1, 0, 0, 1],
                      response_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], turn_ends=[1, 4], step_rewards=[0.0, 1.0])
    spec = EpisodeSpec(env_id="babyai", task_id=3, seed=7, group_id="g1", index=5)
    return EpisodeResult(spec=spec, episode=episode, termination="done", reward=1.0, success=True, score=1.0,
                         step_rewards=[0.0, 1.0], rounds=2, messages=[{"role": "user", "content": "go"}],
                         env_time_s=0.123456, llm_time_s=1.5, wall_time_s=2.0)


def test_a_finished_episode_becomes_a_record_that_reads_back_unchanged(tmp_path: Path):
    record = episode_record(finished_episode(), step=4, kind="train", policy_version=3)
    assert (record.schema, record.step, record.kind, record.index, record.group) == (SCHEMA_VERSION, 4, "train", 5, "g1")
    assert (record.response_mask, record.turn_ends, record.env_time_s) == ([1, 1, 0, 0, 1], [1, 4], 0.1235)
    path = write_dump(tmp_path / "trajectories", 4, "train", [record, record])
    assert path.name == "step_4.jsonl" and [p.name for p in path.parent.iterdir()] == ["step_4.jsonl"]
    assert list(read_dump(path)) == [record, record]
    write_dump(tmp_path / "trajectories", 4, "train", [record], append=True)  # a later batch of the same step
    assert len(list(read_dump(path))) == 3
    assert write_dump(tmp_path / "trajectories", 4, "val", []).name == "val_step_4.jsonl"
    assert [parse_dump_file_name(n) for n in ("step_4.jsonl", "val_step_12.jsonl", ".step_4.jsonl.partial")] == [
        (4, "train"), (12, "val"), None]


def test_a_turn_continued_on_newer_weights_names_each_tokens_version():
    """#72: a turn interrupted at a sync and continued (partial rollout) records the version of each token, compactly;
    observation tokens none (-1)."""
    result = finished_episode()
    result.episode.turn_policy_versions = [2, 3]
    result.episode.token_policy_versions = [2, 3, -1, -1, 3]
    record = TrajectoryRecord.from_json(json.loads(json.dumps(episode_record(result, step=4, kind="train").to_json())))
    assert record.policy_version == 2 and record.extra["turn_policy_versions"] == [2, 3]
    assert record.extra["token_policy_versions"] == [[2, 1], [3, 1], [-1, 2], [3, 1]]


def test_an_episode_that_failed_before_its_prompt_has_empty_token_lists():
    result = finished_episode()
    result.episode, result.termination, result.error = None, "env_error", "create failed"
    record = TrajectoryRecord.from_json(json.loads(json.dumps(result.to_record(step=1))))
    assert (record.prompt_ids, record.response_ids, record.termination) == ([], [], "env_error")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("response_mask"), "missing field(s) response_mask"),
    (lambda d: d.update(schema=99), "schema 99; this reader knows 1"),
    (lambda d: d.update(kind="test"), "kind 'test'; valid: train, val"),
    (lambda d: d.update(response_logprobs=[0.0]), "differ in length"),
])
def test_a_line_that_is_not_a_record_is_named_with_its_field(tmp_path: Path, change, message):
    data = episode_record(finished_episode(), step=1, kind="train").to_json()
    change(data)
    (tmp_path / "step_1.jsonl").write_text("\n" + json.dumps(data) + "\n")
    with pytest.raises(TrajectoryFormatError, match=r"step_1\.jsonl:2: ") as raised:
        list(read_dump(tmp_path / "step_1.jsonl"))
    assert message in str(raised.value)


def test_records_without_the_optional_fields_still_read():
    data = episode_record(finished_episode(), step=1, kind="val").to_json()
    del data["policy_version"], data["extra"]
    data["added_by_a_newer_writer"] = True
    record = TrajectoryRecord.from_json(data)
    assert (record.policy_version, record.extra, record.kind) == (None, {}, "val")
