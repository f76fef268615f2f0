"""Fixtures of the trainer tests: run `python -m recipe.multiturn_rl.main` on CPU for real.

A fixture, not an importable helper: verl's wheel installs its own top-level `tests` package.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest

from beyond_agent.run_folder import MetricsLog
from verl_cpu.overrides import CPU_ENV, cpu_overrides

# The tiny model on 2 cores: small batches, short contexts, one of everything.
SMALL_RUN = [
    "data.max_prompt_length=512", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.max_model_len=1024", "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
    "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
]


def train(tiny_model_dir: Path, run_dir: Path, overrides: list[str], env: dict[str, str] | None = None) -> str:
    """Run the recipe on CPU for real; its output (also appended to `training_output.log` beside `run_dir`, pass
    or fail). Fails with the output's tail on a non-zero exit."""
    command = [sys.executable, "-m", "recipe.multiturn_rl.main", *SMALL_RUN,
               f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.default_local_dir={run_dir}",
               *overrides, *cpu_overrides()]
    environment = {key: value for key, value in os.environ.items() if key != "VERL_FILE_LOGGER_PATH"}
    environment.update({**CPU_ENV, "RAY_DEDUP_LOGS": "0", **(env or {})})
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=1500)
    output = done.stdout + done.stderr
    with (run_dir.parent / "training_output.log").open("a") as log:
        log.write(output)
    assert done.returncode == 0, output[-6000:]
    return output


def launch_training(conf: dict, tiny_model_dir: Path, folder: Path) -> Path:
    """Run `launcher.py --conf <conf> --with-envservice` to its end, its experiment folder under `folder`, the recipe
    trained on CPU with SMALL_RUN, the tiny model and checkpoints in the experiment folder (before the YAML's own
    overrides); return the experiment folder. Fails with the launcher's output on a non-zero exit."""
    import yaml

    train = conf["train"]
    conf = {**conf, "train": {**train, "overrides": [
        *SMALL_RUN, f"actor_rollout_ref.model.path={tiny_model_dir}",
        "trainer.default_local_dir={experiment_dir}/checkpoints", *train["overrides"]]}}
    path = folder / "launcher.yaml"
    path.write_text(f"# python launcher.py --conf {path} --with-envservice\n" + yaml.safe_dump(conf, sort_keys=False))
    environment = {key: value for key, value in os.environ.items() if key != "VERL_FILE_LOGGER_PATH"}
    done = subprocess.run([sys.executable, "launcher.py", "--conf", str(path), "--with-envservice", "--backup-dir",
                           str(folder / "experiments")], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, env=environment, timeout=1500, start_new_session=True)
    (folder / "launcher_output.log").write_text(done.stdout + done.stderr)
    experiments = sorted((folder / "experiments").glob("*/"))
    assert done.returncode == 0 and len(experiments) == 1, (done.stdout + done.stderr)[-6000:]
    return experiments[0]


# ---- the end-to-end training runs the suite shares ------------------------------------------------------------
# Each run pays Ray's, the actor's and vLLM's start-up (minutes on 2 cores), so one run is trained once per
# session and many tests check it, each one property (docs/tests.md maps every check to its run).


@dataclass
class TrainingRun:
    """One finished end-to-end training run: what the tests that share it read."""

    output: str
    """Its console output (stdout + stderr of the recipe's process)."""
    run_dir: Path
    """trainer.default_local_dir: checkpoints, metrics.jsonl, trajectories/, curves.png."""
    workdir: Path
    """The folder holding run_dir and the run's side files (data, dumps, user modules)."""
    metrics_file: Path
    """The file verl's `file` tracker wrote for this run (metrics.jsonl; metrics.<n>.jsonl for a resumed one)."""
    kept: dict = field(default_factory=dict)
    """What a later run in the same folder overwrites, read when this one finished (e.g. its latest checkpoint)."""

    @cached_property
    def metrics(self) -> dict[int, dict[str, float]]:
        """This run's tracked metrics, numbers only: {step: {key: value}} (nan for verl's few text values).

        Read from the tracker's file, not the console: verl prints a step's line in its TaskRunner actor and Ray's
        log monitor can forward a long line in two pieces, losing every key after the cut."""
        return {step: {key: float(value) if isinstance(value, (int, float)) else math.nan
                       for key, value in data.items()} for step, data in self.tracked().items()}

    def tracked(self) -> dict[int, dict]:
        """verl's `file` tracker records of this run: {step: data}, a step's records merged in write order."""
        steps: dict[int, dict] = {}
        for entry in map(json.loads, self.metrics_file.read_text().splitlines()):
            steps.setdefault(entry["step"], {}).update(entry["data"])
        return steps

    def trajectories(self, step: int) -> list[dict]:
        """The episode records the trainer dumped at `step`."""
        lines = (self.run_dir / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="session")
def training_run(tiny_model_dir: Path):
    """training_run(run_dir, overrides, env=None) -> TrainingRun; fails with the output's tail on a non-zero exit."""
    def run(run_dir: Path, overrides: list[str], env: dict[str, str] | None = None) -> TrainingRun:
        earlier = MetricsLog(run_dir).files() if run_dir.is_dir() else []  # a resumed run's folder has some
        output = train(tiny_model_dir, run_dir, overrides, env)
        written = [path for path in MetricsLog(run_dir).files() if path not in earlier]
        assert written, f"the run wrote no metrics file in {run_dir} (trainer.logger needs `file`)"
        return TrainingRun(output, run_dir, run_dir.parent, written[-1])

    return run


@pytest.fixture(scope="session")
def launched_run(tiny_model_dir: Path):
    """launched_run(conf, folder) -> TrainingRun: a run started by launcher.py (launch_training); its `output` is the
    trainer's (logs/train.log), `kept["experiment"]` the experiment folder."""
    def run(conf: dict, folder: Path) -> TrainingRun:
        experiment = launch_training(conf, tiny_model_dir, folder)
        launched = TrainingRun((experiment / "logs" / "train.log").read_text(), experiment / "checkpoints", folder,
                               experiment / "metrics.jsonl")
        launched.kept["experiment"] = experiment
        return launched

    return run


@pytest.fixture(scope="session")
def trainer_envservice(tmp_path_factory: pytest.TempPathFactory):
    """One envservice (BabyAI, FrozenLake, `code` and TicTacToe) for every shared training run of the session."""
    from envservice.process import EnvServiceProcess

    log = tmp_path_factory.mktemp("trainer_envservice") / "envservice.log"
    with EnvServiceProcess(["babyai", "frozenlake", "code", "tictactoe"], log_path=log) as service:
        yield service


FROZENLAKE_LIMITS = dict(max_rounds=6, max_prompt_length=256, max_response_length=256, max_tokens_per_turn=6)


@pytest.fixture(scope="session")
def frozenlake_episodes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """frozenlake_episodes(maps, scripts) -> records: each map played by each script through our EpisodeLoop.

    A script is a function map -> actions ("oracle" gives the BFS shortest path); FrozenLake runs in a real
    envservice, the tokens come from the tiny model's tokenizer and chat template, exactly as a rollout's."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from envservice.envs.frozenlake import shortest_path_actions
    from envservice.process import EnvServiceProcess
    from beyond_agent.rollout.episode_loop import EpisodeLoop, EpisodeConfig, EpisodeSpec
    from beyond_agent.rollout.scripted import ScriptedPolicy
    from beyond_agent.trajectories import episode_record

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limits = EpisodeConfig(**{key: value for key, value in FROZENLAKE_LIMITS.items() if key != "max_rounds"})
    log = tmp_path_factory.mktemp("frozenlake_episodes") / "envservice.log"
    with EnvServiceProcess(["frozenlake"], log_path=log) as service:
        client = EnvClient(service.url)

        def play(maps, scripts, params=None) -> list:
            records = []
            for task in maps:
                created = client.create("frozenlake", task_id=task, seed=task, split="train", params=params or {})
                oracle = shortest_path_actions(created.info["map"])
                client.release(created.session_id)
                for index, script in enumerate(scripts):
                    actions = oracle if script == "oracle" else script(oracle)
                    spec = EpisodeSpec("frozenlake", task_id=task, seed=task, split="train", params=params or {},
                                       group_id=f"map-{task}", index=index)
                    result = EpisodeLoop(spec, client, ScriptedPolicy(actions, tokenizer), tokenizer, limits,
                                      FROZENLAKE_LIMITS["max_rounds"]).run()
                    records.append(episode_record(result, step=0, kind="train"))
            return records

        yield play


@pytest.fixture(scope="session")
def move_writing_model(frozenlake_episodes, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after 60 verl-SFT steps on oracle FrozenLake episodes of maps 100..163: it writes moves
    (the random-weight model never does, so no self-training loop could find anything to learn from)."""
    from beyond_agent.sft import hf_model_dir, run_sft
    from beyond_agent.trajectories import write_dump

    out = tmp_path_factory.mktemp("move_writing_model")
    write_dump(out / "oracle", 0, "train", frozenlake_episodes(range(100, 164), ["oracle"]))
    run_sft([f"data.train_files={out / 'oracle'}", f"model.path={tiny_model_dir}", "data.train_batch_size=16",
             "data.micro_batch_size_per_gpu=16", "trainer.total_training_steps=60", "trainer.total_epochs=15",
             "optim.lr=3e-3", "optim.weight_decay=0.0", f"trainer.default_local_dir={out / 'sft'}",
             f"hydra.run.dir={out / 'hydra'}"], "recipe.sft.main", cpu=True, log_path=out / "sft.log")
    return hf_model_dir(out / "sft")
