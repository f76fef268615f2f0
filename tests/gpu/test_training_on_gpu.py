"""The GPU training checks, as a user runs them, in two training runs (one start-up each: the set must fit one
device call, docs/gpus.md):

1. the quickstart, `launcher.py --conf examples/quickstart/gpu_tiny.yaml --with-envservice` (envservice serving
   BabyAI, the tiny offline Qwen2, verl 0.9's RayPPOTrainer with BeyondAgentTrainer, vLLM on CUDA in bf16): two
   synchronous multi-turn GRPO steps and a checkpoint;
2. `examples/quickstart/gpu_async_m2po.yaml` resumed from that checkpoint for three more steps: episodes of later
   steps played while the actor trains (at most 2 policy versions stale), the M2PO loss trained on them, the
   weights reaching vLLM as deltas with every 2nd sync a full one.

Checked: steps, finite losses, vLLM serving in bf16, the checkpoint and the resume from it (as the CPU suite's
LoRA run resumes in async mode, tests/trainer/test_train_cpu_on_cpu.py); some step trained on stale rows and none
beyond the bound, every admitted episode accounted for, each sync's receiver verified what it loaded, and a delta
sends no more bytes than the full weights (the bytes of each sync are printed). Skipped without CUDA
(tests/gpu/conftest.py).
"""

from __future__ import annotations

import ast
import math
import re

import pytest

from dev_tools.vllm_log import served_dtypes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
QUICKSTART = "examples/quickstart/gpu_tiny.yaml"
ASYNC = "examples/quickstart/gpu_async_m2po.yaml"
RESUMED_STEPS = (3, 4, 5)
ACCOUNTING = re.compile(r"\[beyond_agent\] async rollout accounting: (\{.*\})")
SENT = re.compile(r"\[beyond_agent\] weight_sync sent: step=(\d+) seq=(\d+) mode=(\w+) .*?bytes_sent=(\d+) "
                  r"bytes_full=(\d+) .*?receiver=(verified|REFUSED)")


@pytest.fixture(scope="module")
def quickstart(launch):
    """The sync run; one kept by an earlier device call on this machine (`checks.sh train-sync`) is reused."""
    return launch("quickstart", QUICKSTART, reuse=True)


@pytest.fixture(scope="module")
def resumed(launch, quickstart):
    checkpoints = quickstart.folder / "checkpoints"
    return launch("async_resume", ASYNC, [f"trainer.total_training_steps={RESUMED_STEPS[-1]}",
                                          f"trainer.save_freq={RESUMED_STEPS[-1]}",
                                          f"trainer.default_local_dir={checkpoints}"])


def test_the_quickstart_trains_two_grpo_steps_in_bf16_and_checkpoints(quickstart, rehearsing):
    assert sorted(quickstart.steps) == [1, 2], quickstart.output[-3000:]
    # vLLM serves in bf16, as the YAML asks (float32 in a CPU rehearsal): verl's server arguments and vLLM's
    # engine config, whichever this vLLM release prints, report that dtype and no other.
    dtype = "float32" if rehearsing else "bfloat16"
    served = served_dtypes(quickstart.output)
    assert served == {dtype}, f"the run's log reports vLLM serving in {sorted(served) or 'no dtype'}, not {dtype}"
    for step in (1, 2):
        figures = quickstart.steps[step]
        assert math.isfinite(figures["actor/pg_loss"])
        assert figures["beyond_agent/episodes"] == 8.0  # 4 rows x n=2
        assert math.isfinite(figures["training/rollout_probs_diff_max"])
        assert figures["timing_s/step"] > 0
        # vLLM served the trained weights after the sync (bf16 on both sides; the monitor stops the run otherwise)
        assert figures["beyond_agent/integrity/served_weights"] == 0.0
    latest = quickstart.folder / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert latest.read_text().strip() == "2"
    # A clean exit prints no traceback after it (the 2026-11-28 H200 run printed a DataLoader worker's, killed by
    # Ray at the end: the recipe now loads its rows without worker processes).
    assert "Traceback" not in quickstart.output.split("[beyond_agent] curves:")[-1], quickstart.output[-3000:]


def test_the_async_run_resumes_from_the_quickstarts_checkpoint(resumed, quickstart):
    assert re.search(r"Load from checkpoint folder: \S*global_step_2", resumed.output), resumed.output[-3000:]
    assert sorted(resumed.steps) == list(RESUMED_STEPS)
    # verl saves at the last step; the checkpoints folder is the quickstart's.
    latest = quickstart.folder / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert latest.read_text().strip() == str(RESUMED_STEPS[-1])


def test_async_m2po_trains_on_stale_rows_within_the_bound(resumed):
    staleness = [resumed.steps[step]["beyond_agent/async/staleness_max"] for step in RESUMED_STEPS]
    assert max(staleness) > 0, f"no step trained on stale rows: {staleness}"
    assert all(0 <= value <= 2 for value in staleness), staleness
    for step in RESUMED_STEPS:
        figures = resumed.steps[step]
        assert math.isfinite(figures["actor/pg_loss"])
        assert any(key.endswith("m2po_m2_before") for key in figures), sorted(figures)
        assert figures["beyond_agent/episodes"] == 8.0  # 4 rows x n=2, all from the pool
        assert figures["beyond_agent/weight_sync/bytes_sent"] > 0 and figures["beyond_agent/weight_sync/transfer_s"] > 0
        assert figures["beyond_agent/integrity/served_weights"] == 0.0  # each delta applied is the trained model

    accounting = ast.literal_eval(ACCOUNTING.search(resumed.output).group(1))
    assert accounting["trained"] == 8 * len(RESUMED_STEPS)
    # Every admitted episode trained, dropped or left at the end (no dynamic sampling here: nothing dropped for
    # lack of signal, so that entry may be absent).
    accounted = sum(accounting.get(key, 0) for key in ("trained", "dropped_stale", "dropped_no_signal",
                                                       "left_unfinished_at_end", "left_finished_at_end"))
    assert accounting["admitted"] == accounted, accounting


def test_each_delta_sync_is_verified_and_no_larger_than_a_full_one(resumed):
    # One sync before the first resumed step and one after each: full, delta, full, delta (full_every=2).
    sent = [(int(step), int(seq), mode, int(sent_b), int(full_b), receiver)
            for step, seq, mode, sent_b, full_b, receiver in SENT.findall(resumed.output)]
    assert [(s[1], s[2], s[5]) for s in sent] == [(0, "full", "verified"), (1, "delta", "verified"),
                                                  (2, "full", "verified"), (3, "delta", "verified")], sent
    # A delta carries the changed elements only, so it is never larger than a full sync; how much smaller depends
    # on how many bf16 weights one update moves (on CPU in float32 nearly all: the same bytes), so it is printed.
    full_bytes = sent[0][4]
    assert all(s[3] == full_bytes for s in sent if s[2] == "full")
    assert all(0 < s[3] <= full_bytes for s in sent if s[2] == "delta"), sent
    print("weight syncs (step, seq, mode, bytes sent, bytes full):", [s[:5] for s in sent])
