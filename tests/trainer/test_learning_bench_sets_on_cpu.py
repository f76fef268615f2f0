"""The learning bench calls a set held-out only when no stage trained on any of its maps, checked by content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envservice.contamination import contamination
from launch.experiment import write_commands
from launch.secrets import Redactor
from verl_cpu.overrides import PLACEMENT_OVERRIDES, cpu_overrides



@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("learning_cpu")


@pytest.mark.parametrize("argv", [
    [],                                                              # the learning check's defaults
    ["--seeds", "0", "1", "--rl", "grpo", "--offline", "sft", "dpo"],  # the two-seed table
    ["--rl", "grpo_stable", "--rl-steps", "12", "--samples", "2"],     # the quickstart
    ["--size", "6", "--seeds", "0", "1", "--rl", "grpo", "grpo_scaling", "m2po_async"],  # the longer-horizon check
    ["--env", "babyai", "--seeds", "0", "1", "2", "--rl", "grpo", "gigpo"],  # BabyAI layouts (#53)
    ["--env", "tictactoe", "--seeds", "0", "1", "2", "--rl", "grpo"],  # TicTacToe positions (#57)
])
def test_the_bench_sets_called_held_out_share_no_map_with_any_training_set(bench, argv) -> None:
    args = bench.parse_args(argv)
    report = bench.contamination_report(args)
    assert report["heldout"]["shared_any"] == 0 and report["heldout"]["tasks"] == args.heldout_maps == 64
    # FrozenLake's test maps are 64 distinct ones, and so are BabyAI GoToRedBall's layouts (up to the room's symmetries);
    # TicTacToe has 21 test positions up to symmetry (of 108 after 4 moves), each evaluated about 3 times
    assert report["heldout"]["distinct"] == {"frozenlake": 64, "babyai": 64, "tictactoe": 21}[args.env]
    assert report["validation"] == report["heldout"]  # verl's validation during RL plays the same maps
    assert set(report["heldout"]["shared"]) == {"warm-up", "rl pool", *(["own episodes"] if args.offline else [])}
    # the train set is the RL pool's first maps: the check does see maps that were trained on
    assert report["train"]["shared"]["rl pool"] == report["train"]["tasks"] == 32
    bench.require_unseen(report)
    lines = bench.contamination_lines(report)
    assert lines[0] == (f"contamination by content: heldout: 64 maps ({report['heldout']['distinct']} distinct), shared "
                        f"with warm-up 0, rl pool 0" + (", own episodes 0" if args.offline else ""))
    assert all(len(line) < 600 for line in lines)  # the console's line, not the report


def test_the_bench_refuses_a_held_out_set_that_was_trained_on(bench) -> None:
    args = bench.parse_args([])
    trained = [maps.task_set(args.game) for maps in bench.training_sets(args)]
    pool_maps = bench.MapSet("heldout", "train", 8, first=100)  # 8 maps of the RL pool, called held-out
    with pytest.raises(SystemExit, match=r"the heldout set is not held-out: 8 of its 8 maps are trained on "
                                         r"\(\{'warm-up': \d+, 'rl pool': 8\}\)"):
        bench.require_unseen({"heldout": contamination(pool_maps.task_set(args.game), trained)})


def test_babyai_maps_are_layouts_of_one_level_and_the_bot_solves_them_through_the_episode_loop(bench, serve_app,
                                                                                          tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.server import EnvServiceConfig, create_app

    game = bench.parse_args(["--env", "babyai"]).game
    assert bench.MapSet("heldout", "test", 3).task_set(game).tasks == tuple(
        ("BabyAI-GoToRedBall-v0", seed) for seed in range(3))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with serve_app(create_app(EnvServiceConfig(env_ids=["babyai"]))) as url, EnvClient(url) as client:
        records = [bench.oracle_record(client, tokenizer, number, game) for number in (500, 501, 502)]
    assert all(record.success and record.termination == "done" for record in records)
    assert all(record.rounds <= game.limits["max_rounds"] - 2 for record in records)


def test_tictactoe_positions_are_won_by_minimax_through_the_episode_loop_in_the_compact_view(bench, serve_app,
                                                                                       tiny_model_dir) -> None:
    """The warm-up's oracle reads each view's board and plays minimax against the random player: it wins these
    positions within the limits, every move a free cell of the board it was shown."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.server import EnvServiceConfig, create_app

    game = bench.parse_args(["--env", "tictactoe"]).game
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with serve_app(create_app(EnvServiceConfig(env_ids=["tictactoe"]))) as url, EnvClient(url) as client:
        records = [bench.oracle_record(client, tokenizer, number, game) for number in range(500, 510)]
    assert all(record is not None and record.success and record.termination == "done" for record in records)
    assert all(record.rounds <= 3 and len(record.prompt_ids) <= game.limits["max_prompt_length"] for record in records)
    for record in records:
        for view, move in zip(record.messages[1::2], record.messages[2::2]):
            assert move["role"] == "assistant" and move["content"].strip("[]") in view["content"].split(
                "Free cells: ")[1].split(".")[0].split()


def test_moves_into_a_hole_the_observation_named_are_counted(bench):
    import types

    def seen(left, down, right, up):
        return {"role": "user", "content": f"map ...\nAround you: left {left}, down {down}, right {right}, up {up}."}

    def move(action):
        return {"role": "assistant", "content": f"I go {action}."}

    reading = types.SimpleNamespace(messages=[seen("#", "H", "F", "#"), move("right"), seen("F", "F", "G", "#"),
                                              move("right")])
    blind = types.SimpleNamespace(messages=[seen("#", "H", "F", "#"), move("down")])
    no_hole = types.SimpleNamespace(messages=[seen("#", "F", "F", "#"), move("down")])
    # reading: beside a hole once, stepped away; blind: beside one, stepped in; no hole: not counted; a random move
    # beside one named hole of four steps in a quarter of the time: 0.25 + 0.25
    assert bench.visible_hole_moves([reading, blind, no_hole]) == (1, 2, 0.5)
    surrounded = types.SimpleNamespace(messages=[seen("H", "H", "H", "H"), move("up")])
    assert bench.visible_hole_moves([surrounded]) == (1, 1, 1.0)


def test_a_warm_up_is_said_to_read_the_map_only_above_the_plateau_and_well_under_chance_at_named_holes(bench):
    reads = {"heldout": {"greedy": 0.40, "greedy_hole_moves": [5, 120, 33.0]}}
    assert bench.reading_problems(reads, 0.281) == []
    # the frozen warm-up of 2026-11-29: one map above the plateau, and into named holes more often than chance
    blind = {"heldout": {"greedy": 0.297, "greedy_hole_moves": [44, 121, 33.25]}}
    [problem] = bench.reading_problems(blind, 0.281)
    assert problem.startswith("its greedy moves stepped into a hole the observation named 44 times of 121")
    assert len(bench.reading_problems({"heldout": {"greedy": 0.25}}, 0.281)) == 1  # holes not measured: not judged
    args = bench.parse_args(["--warmup-seed", "0"])
    args.plateau = 0.281
    with pytest.raises(SystemExit, match="the warm-up does not read the map: its greedy moves stepped into a hole"):
        bench.require_reading_warmup(blind, args)


def test_the_warm_up_schedule_reaches_verls_optimiser_and_keeps_earlier_warm_ups_reusable(bench):
    import verl
    from omegaconf import OmegaConf

    earlier = bench.parse_args([])
    assert bench.later_warmup_settings(earlier) == {}  # an earlier run's recorded settings still match
    assert bench.warmup_schedule_overrides(earlier.warmup_schedule) == []
    cosine = bench.parse_args(["--warmup-schedule", "cosine", "--warmup-clip-grad", "1.0"])
    assert bench.later_warmup_settings(cosine) == {"schedule": "cosine", "clip_grad": 1.0}
    # every override names a key of verl's own optimiser config (the run's `train/lr` shows the schedule took)
    optim = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "optim" / "fsdp.yaml")
    for override in bench.warmup_schedule_overrides("cosine"):
        assert override.removeprefix("optim.").split("=")[0] in optim, override
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup-schedule", "linear"])


def test_the_rl_stage_finds_its_run_folder_beside_the_runs_log(bench, tmp_path):
    # The RL run's console log is written in the experiments folder until the run ends, so it is the newest new
    # entry there: the run folder is the newest new *folder* (a run stage once looked for its checkpoint in the log).
    earlier = tmp_path / "learning_cpu_frozenlake-20261129-100000"
    earlier.mkdir()
    before = set(tmp_path.iterdir())
    run = tmp_path / "learning_cpu_frozenlake-20261129-120000"
    run.mkdir()
    (tmp_path / "grpo_stable_seed0.log").write_text("the run's output, written last\n")
    assert bench.new_run_folder(tmp_path, before) == run
    with pytest.raises(SystemExit, match="made no run folder"):
        bench.new_run_folder(tmp_path, set(tmp_path.iterdir()))


LAUNCHED = ["/venv/bin/python", "launcher.py", "--conf", "bench/learning_cpu.yaml", "--", "data.seed=0"]
TRAINED = ["python", "-m", "recipe.multiturn_rl.main", *cpu_overrides(), "data.seed=0"]  # what the launcher ran


def run_folder(bench, experiments: Path, name: str, launched: list[str], last_step: int,
               trained: list[str] = TRAINED) -> Path:
    """A run folder as the launcher leaves it: command.txt (the launcher's own writer), the last checkpoint."""
    folder = experiments / name
    checkpoint = bench.final_checkpoint(folder, last_step)
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    write_commands(folder, launched, trained, Redactor())
    return folder


def with_length(command: list[str], steps: int) -> list[str]:
    """An RL stage's launcher command for a run of `steps` steps (the bench's own length arguments)."""
    return [*command, f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
            f"trainer.test_freq={max(1, steps // 3)}"]


def test_an_rl_stage_reuses_a_finished_run_of_the_same_command_only(bench, tmp_path):
    # A bench stopped after a 25-minute RL run resumes with its evaluation: a run folder is reused when the
    # launcher line its command.txt records is this stage's command and its last checkpoint is written.
    command = LAUNCHED
    run_folder(bench, tmp_path, "other-seed", [*command[:-1], "data.seed=1"], 20)
    run_folder(bench, tmp_path, "cut-short", command, 10)
    # The same launcher command before a CPU override changed: the launcher added other ones (the actor trained in
    # bf16 before its fp32 override), so its figures are not this code's.
    run_folder(bench, tmp_path, "older-cpu-settings", command, 20,
               [arg for arg in TRAINED if "fsdp_config.mixed_precision" not in arg])
    (tmp_path / "grpo_stable_seed0.log").write_text("a log is not a run\n")
    assert bench.finished_run(tmp_path, command, 20) is None
    # Before vLLM's worker moved into its engine core: placed otherwise, the same settings computed.
    placed = run_folder(bench, tmp_path, "worker-apart", command, 20,
                        [arg for arg in TRAINED if arg not in PLACEMENT_OVERRIDES])
    assert bench.finished_run(tmp_path, command, 20) == placed
    assert bench.finished_run(tmp_path, [*command, "actor_rollout_ref.actor.loss_agg_mode=token-mean"], 20) is None


def test_an_rl_stage_asked_for_more_steps_continues_the_longest_shorter_run(bench, tmp_path):
    # 20 more steps of a 20-step run cost 20 steps, not 40: the stage resumes the earlier run's last checkpoint
    # (verl's resume_path) when the launcher commands differ in the run's length alone.
    run_folder(bench, tmp_path, "ten", with_length(LAUNCHED, 10), 10)
    twenty = run_folder(bench, tmp_path, "twenty", with_length(LAUNCHED, 20), 20)
    run_folder(bench, tmp_path, "other-seed", with_length([*LAUNCHED[:-1], "data.seed=1"], 30), 30)
    run_folder(bench, tmp_path, "bf16", with_length(LAUNCHED, 30), 30,
               [arg for arg in TRAINED if "fsdp_config.mixed_precision" not in arg])
    run_folder(bench, tmp_path, "longer", with_length(LAUNCHED, 60), 60)
    unfinished = tmp_path / "stopped"  # a 30-step run stopped before its last checkpoint
    (unfinished / "checkpoints" / "global_step_10").mkdir(parents=True)
    write_commands(unfinished, with_length(LAUNCHED, 30), TRAINED, Redactor())
    wanted = with_length(LAUNCHED, 40)
    assert bench.finished_run(tmp_path, wanted, 40) is None
    assert bench.continuable_run(tmp_path, wanted, 40) == (twenty, 20)
    assert bench.continuable_run(tmp_path, with_length(LAUNCHED, 20), 20) == (tmp_path / "ten", 10)
    assert bench.continuable_run(tmp_path, with_length([*LAUNCHED, "algorithm.adv_estimator=gigpo"], 40), 40) is None
    # The continued run records the earlier checkpoint, and a later call of the 40-step stage reuses it.
    resume = [f"{bench.CONTINUATION[0]}resume_path",
              f"{bench.CONTINUATION[1]}{twenty / 'checkpoints' / 'global_step_20'}"]
    continued = run_folder(bench, tmp_path, "continued", [*wanted, *resume], 40)
    assert bench.finished_run(tmp_path, wanted, 40) == continued
    assert bench.continued_from(continued) == str(twenty / "checkpoints" / "global_step_20")
    assert bench.continued_from(twenty) is None
    assert bench.recorded_steps(continued) == 40

def test_the_bench_s_curve_reads_held_out_success_not_mean_reward(bench, tmp_path: Path) -> None:
    # BabyAI pays less for longer paths, so its validation's mean reward (0.437) is not its success share (0.484)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 0, "data": {"val-core/babyai/reward/mean@1": 0.437, "val-aux/babyai/success/mean@1": 0.484}}\n'
        '{"step": 1, "data": {"beyond_agent/success_rate": 0.5}}\n'
        '{"step": 2, "data": {"val-core/frozenlake/reward/mean@1": 0.25}}\n')
    assert bench.success_curve(metrics, "babyai") == [(0, None, 0.484), (1, 0.5, None), (2, None, None)]
    assert bench.success_curve(metrics, "frozenlake")[2] == (2, None, 0.25)  # older files: the reward, 0 or 1


def _keep(folder: Path, stage: str, heldout_greedy: float) -> None:
    (folder / "stages").mkdir(parents=True, exist_ok=True)
    figures = {"heldout": {"greedy": heldout_greedy, "sampled": 0.25}, "train": {"greedy": 0.25, "sampled": 0.25}}
    (folder / "stages" / f"{stage}.json").write_text(json.dumps(figures))


def test_the_table_of_kept_seeds_counts_each_seeds_lift_over_its_warm_up(bench, tmp_path, capsys) -> None:
    # a row's seeds run in separate calls (one a session on 2 cores): --table reads what each kept, runs nothing
    for seed, after_rl in ((0, 0.5), (1, 0.25), (2, 0.625)):
        _keep(tmp_path / f"seed{seed}", "warm-up", 0.375)
        _keep(tmp_path / f"seed{seed}", "grpo_stable", after_rl)
    _keep(tmp_path / "seed3", "warm-up", 0.375)  # a seed whose RL run has not finished: not in the row

    assert bench.main(["--seeds", "0", "1", "2", "3", "--kept", str(tmp_path), "--table"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("grpo_stable"))
    # lifts +12.5, -12.5, +25.0 points over the warm-up's 37.5 %: two reach 10 points, mean +8.3
    assert row.split()[1:3] == ["45.8%", "[25.0-62.5]"]
    assert row.endswith("lifted >= 10%: 2 of 3 seeds (mean +8.3; +12.5, -12.5, +25.0 points)")

    with pytest.raises(SystemExit, match=r"seed 5 has no kept warm-up figures .*seed5/stages/warm-up.json.*"
                                         r"kept seeds: \[0, 1, 2, 3\]"):
        bench.main(["--seeds", "0", "5", "--kept", str(tmp_path), "--table"])
