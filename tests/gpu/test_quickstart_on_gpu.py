"""The quickstart on a real GPU: two multi-turn GRPO steps in bf16, a checkpoint, and a resume from it.

Everything is what a user runs: `launcher.py --conf examples/quickstart/gpu_tiny.yaml --with-envservice`
(envservice serving BabyAI, the tiny offline Qwen2, verl 0.9's RayPPOTrainer with BeyondAgentTrainer, vLLM on
CUDA), then the same YAML again, pointed at the first run's checkpoints with one more step to train.
Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import math
import re

import pytest

from dev_tools.vllm_log import served_dtypes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
YAML = "examples/quickstart/gpu_tiny.yaml"


def test_two_grpo_steps_in_bf16_then_a_resume_trains_step_three(launch, rehearsing):
    first = launch("quickstart", YAML)
    assert sorted(first.steps) == [1, 2], first.output[-3000:]
    # vLLM serves in bf16, as the YAML asks (float32 in a CPU rehearsal): verl's server arguments and vLLM's
    # engine config, whichever this vLLM release prints, report that dtype and no other.
    dtype = "float32" if rehearsing else "bfloat16"
    served = served_dtypes(first.output)
    assert served == {dtype}, f"the run's log reports vLLM serving in {sorted(served) or 'no dtype'}, not {dtype}"
    for step in (1, 2):
        figures = first.steps[step]
        assert math.isfinite(figures["actor/pg_loss"])
        assert figures["beyond_agent/episodes"] == 8.0  # 4 rows x n=2
        assert math.isfinite(figures["training/rollout_probs_diff_max"])
        assert figures["timing_s/step"] > 0
    checkpoints = first.folder / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    resumed = launch("resume", YAML, ["trainer.total_training_steps=3", f"trainer.default_local_dir={checkpoints}"])
    assert re.search(r"Load from checkpoint folder: \S*global_step_2", resumed.output), resumed.output[-3000:]
    assert sorted(resumed.steps) == [3]
    assert math.isfinite(resumed.steps[3]["actor/pg_loss"])
    # verl saves at the last step whatever save_freq says.
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
