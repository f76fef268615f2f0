"""Where a launcher run's time goes (dev_tools/run_phases.py, issue #74): the GPU checks print each call's phases,
cut by the first line that marks each one, from output lines stamped with their arrival."""

from __future__ import annotations

import json

from dev_tools.run_phases import main, phase_table, phase_times, step_times

# A run's output as the quickstart prints it (Ray's actor prefixes included), each line with its arrival in seconds.
LINES = [
    (0.4, "[launcher] experiment folder: /tmp/run"),
    (4.2, "[launcher] envservice is healthy at http://127.0.0.1:43285 after 3.8 s"),
    (49.0, "[launcher] training: python -m recipe.multiturn_rl.main ..."),
    (59.0, "2026-11-28 20:01:11,013\tINFO worker.py:2024 -- Started a local Ray instance."),
    (115.0, "\x1b[36m(WorkerDict pid=2715)\x1b[0m Total steps: 2, num_warmup_steps: 0"),
    (280.0, "\x1b[36m(BeyondAgentTaskRunner pid=2465)\x1b[0m LLMServerManager: ['192.0.2.2:40273']"),
    (282.5, "\x1b[36m(BeyondAgentTaskRunner pid=2465)\x1b[0m Training from scratch"),
    (286.0, "\x1b[36m(WorkerDict pid=2715)\x1b[0m INFO:2026-11-28 20:04:58,000:update_weights done, time cost: 3.52s"),
    (314.0, "\x1b[36m(BeyondAgentTaskRunner pid=2465)\x1b[0m [beyond_agent] step 1 training rollout: 8 episodes"),
    (318.0, "[launcher] step 1: score=0, reward=0, step_s=35.83"),
    (330.0, "\x1b[36m(BeyondAgentTaskRunner pid=2465)\x1b[0m [beyond_agent] step 2 training rollout: 8 episodes"),
    (331.5, "[launcher] step 2: score=0, reward=0, step_s=13.5"),
    (337.0, "[launcher] training exited with code 0"),
]


def test_each_phase_ends_at_its_first_marking_line_and_steps_are_timed():
    assert phase_times(LINES) == [("envservice up", 4.2), ("model and data prepared", 49.0), ("Ray up", 59.0),
                                  ("actor workers up (FSDP)", 115.0), ("vLLM servers up", 280.0),
                                  ("checkpoint loaded (or none)", 282.5), ("first weight sync done", 286.0),
                                  ("first rollout played", 314.0),
                                  ("first step done", 318.0), ("training exited", 337.0)]
    assert step_times(LINES) == {1: 318.0, 2: 331.5}


def test_the_table_gives_each_phase_its_share_and_a_run_cut_short_shows_how_far_it_got(tmp_path, capsys):
    table = phase_table(LINES, "quickstart").splitlines()
    assert "| vLLM servers up | 280.0 | 165.0 |" in table  # 115 s -> 280 s: vLLM's start-up
    assert table[-2] == "seconds to each step's figures (the first counts from the start): 1: 318.0, 2: 13.5"
    assert table[-1] == "whole run: 337.0 s"
    cut = phase_table(LINES[:5], "cut at the limit")
    assert "| actor workers up (FSDP) | 115.0 | 56.0 |" in cut and "vLLM" not in cut and "step" not in cut
    recorded = tmp_path / "quickstart.times.jsonl"
    recorded.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    assert main([str(recorded)]) == 0
    assert "| training exited | 337.0 | 19.0 |" in capsys.readouterr().out  # from the first step's figures
