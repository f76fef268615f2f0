"""Asynchronous rollout with M2PO and delta weight sync on a real GPU, three steps.

`launcher.py --conf examples/quickstart/gpu_async_m2po.yaml --with-envservice`: episodes of later steps are
played while the actor trains (at most 2 policy versions stale), the M2PO loss trains on them, and the weights
reach vLLM as deltas with every 2nd sync a full one. Checked: some step trained on stale rows and none beyond
the bound, every admitted episode is accounted for, each sync's receiver verified what it loaded, and a delta
sends no more bytes than the full weights (the bytes of each sync are printed). Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import ast
import math
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
YAML = "examples/quickstart/gpu_async_m2po.yaml"
ACCOUNTING = re.compile(r"\[beyond_agent\] async rollout accounting: (\{.*\})")
SENT = re.compile(r"\[beyond_agent\] weight_sync sent: step=(\d+) seq=(\d+) mode=(\w+) .*?bytes_sent=(\d+) "
                  r"bytes_full=(\d+) .*?receiver=(verified|REFUSED)")


def test_async_m2po_with_delta_sync_trains_three_steps(launch):
    run = launch("async_m2po", YAML)
    assert sorted(run.steps) == [1, 2, 3], run.output[-3000:]
    staleness = [run.steps[step]["beyond_agent/async/staleness_max"] for step in (1, 2, 3)]
    assert max(staleness) > 0, f"no step trained on stale rows: {staleness}"
    assert all(0 <= value <= 2 for value in staleness), staleness
    for step in (1, 2, 3):
        figures = run.steps[step]
        assert math.isfinite(figures["actor/pg_loss"])
        assert any(key.endswith("m2po_m2_before") for key in figures), sorted(figures)
        assert figures["beyond_agent/episodes"] == 8.0  # 4 rows x n=2, all from the pool
        assert figures["weight_sync/bytes_sent"] > 0 and figures["weight_sync/transfer_s"] > 0

    accounting = ast.literal_eval(ACCOUNTING.search(run.output).group(1))
    assert accounting["trained"] == 24
    # Every admitted episode trained, dropped or left at the end (no dynamic sampling here: nothing dropped for
    # lack of signal, so that entry may be absent).
    accounted = sum(accounting.get(key, 0) for key in ("trained", "dropped_stale", "dropped_no_signal",
                                                       "left_unfinished_at_end", "left_finished_at_end"))
    assert accounting["admitted"] == accounted, accounting

    # One sync before step 1 and one after each step: full, delta, full, delta (full_every=2), all verified.
    sent = [(int(step), int(seq), mode, int(sent_b), int(full_b), receiver)
            for step, seq, mode, sent_b, full_b, receiver in SENT.findall(run.output)]
    assert [(s[1], s[2], s[5]) for s in sent] == [(0, "full", "verified"), (1, "delta", "verified"),
                                                  (2, "full", "verified"), (3, "delta", "verified")], sent
    # A delta carries the changed elements only, so it is never larger than a full sync; how much smaller depends
    # on how many bf16 weights one update moves (on CPU in float32 nearly all: the same bytes), so it is printed.
    full_bytes = sent[0][4]
    assert all(s[3] == full_bytes for s in sent if s[2] == "full")
    assert all(0 < s[3] <= full_bytes for s in sent if s[2] == "delta"), sent
    print("weight syncs (step, seq, mode, bytes sent, bytes full):", [s[:5] for s in sent])
