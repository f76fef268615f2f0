"""The generic part of an RL recipe's program: what every recipe built on BeyondAgentTrainer does before and
around its training, so that a recipe (or a fork of one) is its trainer class, its YAML and a few lines of main:

    @hydra.main(config_path="config", config_name="beyond_agent_trainer", version_base=None)
    def main(config) -> None:
        run_recipe(MyTrainer, config)

`run_recipe` checks the config before Ray starts (`check_config`: ours, the agent's import, the task weights
against the train files, verl's own `validate_config`, the GPU plan's warnings), stops there in a dry run, then
hands over to verl's `run_ppo` with a TaskRunner (`task_runner_class`) that builds verl's workers and datasets like
verl's legacy runner does and trains with the recipe's trainer class.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf

from beyond_agent.cli_args import DRY_RUN_MARKER, is_dry_run
from beyond_agent.gpu_plan import GPU_PLAN_NOTE, GPU_PLAN_WARNING, model_shape, plan
from beyond_agent.run_folder import METRICS_PATH_VARIABLE, metrics_path
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.training import prepare_verl_config


def run_recipe(trainer_class: type, config: Any) -> None:
    """Check the config (ours and verl's), then train with `trainer_class` through verl's `run_ppo` (in a dry run,
    `BEYOND_AGENT_DRY_RUN=1`, stop after the checks). The recipe's main checked the verl pin when it imported
    its trainer."""
    check_config(config)
    if is_dry_run():  # launcher.py --dry-run: composed and checked, nothing starts
        print(DRY_RUN_MARKER, flush=True)
        return
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    run_ppo(config, task_runner_class=task_runner_class(trainer_class))


def check_config(config) -> None:
    """Refuse configs this recipe cannot run, with the key to change."""
    if config.trainer.get("use_v1", False):
        raise SystemExit("BeyondAgent subclasses verl's legacy RayPPOTrainer: set trainer.use_v1=false "
                         "(the RL recipe's config/beyond_agent_trainer.yaml does)")
    # The checks below run on one resolved copy: the trainer prepares verl's config itself, and this dry run
    # refuses a run it cannot serve now, instead of inside Ray minutes later.
    resolved = copy.deepcopy(config)
    OmegaConf.resolve(resolved)
    try:
        beyond_config = BeyondAgentConfig.from_config(config)
        if beyond_config.agent.active:  # the user's agent imports (or its program is found) here, not in the rollout
            beyond_config.agent.load(beyond_config.episode.episode_timeout_s)
        prepare_verl_config(resolved, beyond_config)
        check_reward_workers(resolved)
        check_task_weights_against_files(beyond_config.multitask.task_weights, config.data.train_files)
    except ValueError as error:  # a bad key: one sentence naming it, before Ray starts
        raise SystemExit(f"beyond_agent config: {error}") from None
    validate_with_verl(resolved)
    report_gpu_plan(resolved)


def report_gpu_plan(resolved) -> None:
    """Print what the GPU memory and layout estimate (beyond_agent.gpu_plan) finds will not fit in a resolved
    config, as warnings (estimates do not refuse a run), and its throughput notes; nothing on CPU."""
    if resolved.trainer.get("device", "cuda") == "cpu":
        return
    shape = model_shape(str(resolved.actor_rollout_ref.model.path))
    if shape is None:
        print(f"[beyond_agent] no GPU memory estimate: {resolved.actor_rollout_ref.model.path} is neither a local "
              "folder with config.json nor in beyond_agent.gpu_plan.KNOWN_MODELS", flush=True)
        return
    found = plan(OmegaConf.to_container(resolved), shape)
    for problem in found.problems():
        print(f"{GPU_PLAN_WARNING} {problem}", flush=True)
    for note in found.notes():
        print(f"{GPU_PLAN_NOTE} {note}", flush=True)


def validate_with_verl(resolved) -> None:
    """verl's own `validate_config` (batch sizes against GPUs, micro-batch keys, the actor/critic dataclasses) on
    a resolved config, before Ray starts; verl runs it again inside its TaskRunner."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(config=resolved, use_reference_policy=need_reference_policy(resolved),
                        use_critic=need_critic(resolved))
    except (AssertionError, ValueError, TypeError) as error:
        raise SystemExit(f"verl config (verl.utils.config.validate_config): {error}") from None


def check_reward_workers(resolved) -> None:
    """A reward model scores through verl's reward loop workers, of which the recipe starts none by default (its
    rollout scores through envservice): refuse the pair rather than fail inside Ray."""
    if resolved.reward.reward_model.get("enable", False) and resolved.reward.num_workers < 1:
        raise ValueError(f"reward.num_workers={resolved.reward.num_workers} with reward.reward_model.enable=true: "
                         "verl's reward model scores through its reward loop workers; set reward.num_workers to 1 "
                         "or more")


def check_task_weights_against_files(weights, train_files) -> None:
    """`beyond_agent.multitask.task_weights` against the tasks of local train parquet files, before Ray starts
    (files that are not local, e.g. hdfs://, are checked by the sampler once verl has copied them)."""
    if weights is None:
        return
    from beyond_agent.multitask import check_task_weights, parquet_task_names

    files = [str(train_files)] if isinstance(train_files, str) else [str(path) for path in train_files]
    if all(Path(path).is_file() for path in files):
        check_task_weights(weights, parquet_task_names(files))


def build_datasets(config, tokenizer, processor, multitask):
    """verl's RL datasets for the train and val parquet files written by beyond_agent.data, and the
    train sampler: the weighted task sampler when `multitask.task_weights` is set, else verl's."""
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler

    from beyond_agent.multitask import task_sampler

    train = create_rl_dataset(config.data.train_files, config.data, tokenizer, processor, is_train=True,
                              max_samples=config.data.get("train_max_samples", -1))
    val = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor, is_train=False,
                            max_samples=config.data.get("val_max_samples", -1))
    sampler = task_sampler(multitask, train, config.data.get("seed"))
    if sampler is not None:
        print(f"[beyond_agent] {sampler.describe()}", flush=True)
    return train, val, sampler or create_rl_sampler(config.data, train)


def task_runner_class(trainer_class: type):
    """The Ray actor class that builds verl's workers and datasets and trains with `trainer_class` (defined here,
    lazily: verl's runner base class is imported only once verl is known to be the pinned one)."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner

    class BeyondAgentTaskRunner(BaseTaskRunner):
        """Ray actor that builds verl's workers and datasets and runs the recipe's trainer's fit()."""

        def run(self, config):
            from verl.trainer.ppo.utils import need_critic, need_reference_policy
            from verl.utils.config import omega_conf_to_dataclass, validate_config
            from verl.utils.dataset.rl_dataset import collate_fn

            print(f"[beyond_agent] TaskRunner pid {os.getpid()}", flush=True)
            OmegaConf.resolve(config)
            metrics = metrics_path(config)
            if metrics is not None:  # read by verl's `file` tracker when fit() starts, in this process
                metrics.parent.mkdir(parents=True, exist_ok=True)
                os.environ[METRICS_PATH_VARIABLE] = str(metrics)
                print(f"[beyond_agent] metrics: {metrics}", flush=True)
            _, worker_group_cls = self.add_actor_rollout_worker(config)
            self.add_critic_worker(config)
            self.add_reward_model_resource_pool(config)
            self.add_teacher_model_resource_pool(config)
            validate_config(config=config, use_reference_policy=need_reference_policy(config),
                            use_critic=need_critic(config))
            model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
            beyond_config = BeyondAgentConfig.from_config(config)  # once in this process; the trainer takes it
            train, val, sampler = build_datasets(config, model_config.tokenizer, model_config.processor,
                                                 beyond_config.multitask)
            trainer = trainer_class(
                config=config, beyond_config=beyond_config, tokenizer=model_config.tokenizer,
                processor=model_config.processor,
                role_worker_mapping=self.role_worker_mapping, resource_pool_manager=self.init_resource_pool_mgr(config),
                ray_worker_group_cls=worker_group_cls, train_dataset=train, val_dataset=val,
                collate_fn=collate_fn, train_sampler=sampler,
            )
            trainer.init_workers()
            trainer.fit()

    return ray.remote(BeyondAgentTaskRunner)
