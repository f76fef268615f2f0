"""The example launcher YAMLs and scripts: each starts with its command, parses, and composes with Hydra."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launch.config import load_config
from launch.training import train_command
from beyond_agent.settings import BeyondAgentConfig
from recipe.multiturn_rl.main import check_config

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_CONFIGS = sorted((REPO_ROOT / "examples").glob("*/envs.yaml"))
"""envservice env-config files (`--env-config`), not launcher YAMLs."""
EXAMPLES = sorted(set((REPO_ROOT / "examples").glob("*/*.yaml")) - set(ENV_CONFIGS))
SCRIPTS = sorted((REPO_ROOT / "examples").glob("**/run_*.sh"))
SECRET = re.compile(r"(TOKEN|API_KEY|SECRET|PASSWORD)\s*[=:]\s*\S", re.IGNORECASE)


def example_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT / "examples"))


def test_every_environment_has_a_yaml_and_a_script():
    for env in ("babyai", "textcraft", "frozenlake", "sciworld", "alfworld", "textworld", "search", "appworld",
                "webshop", "webarena", "code", "terminal", "tictactoe"):
        assert (REPO_ROOT / "examples" / env / f"{env}.yaml").exists()
        assert (REPO_ROOT / "examples" / env / f"run_{env}.sh").exists()
    for domain in ("retail", "airline"):  # τ²-bench's two domains share a folder
        assert (REPO_ROOT / "examples" / "tau2" / f"tau2_{domain}.yaml").exists()
        assert (REPO_ROOT / "examples" / "tau2" / f"run_tau2_{domain}.sh").exists()
    assert (REPO_ROOT / "examples" / "quickstart" / "cpu_tiny.yaml").exists()
    assert (REPO_ROOT / "examples" / "quickstart" / "cpu_async_m2po.yaml").exists()
    for env, mode in M2PO_VARIANTS.values():   # each AgentBench-recipe variant has its thin run script
        assert (REPO_ROOT / "examples" / env / f"run_{env}_m2po_{mode}.sh").exists()


@pytest.mark.parametrize("path", ENV_CONFIGS, ids=example_id)
def test_env_configs_load_and_every_launcher_yaml_names_an_existing_one(path, monkeypatch):
    """Each shipped env-config registers its envs (class imported, config valid, `${VAR:-default}` filled)."""
    from envservice import registry
    from envservice.env_config import load_env_config

    monkeypatch.delenv("WEBSHOP_URL", raising=False)
    registrations = load_env_config(path)
    try:
        assert registrations and all(r.env_class().task_counts() for r in registrations)
        assert all(r.config["url"].startswith("http://127.0.0.1:") for r in registrations if "url" in r.config)
    finally:
        for registration in registrations:
            registry.unregister(registration.env_id)
    for example in EXAMPLES:
        env_config = (load_config(example, Path("/nonexistent.env")).services.get("envservice") or None)
        if env_config and "--env-config" in env_config.command:
            assert (REPO_ROOT / env_config.command[env_config.command.index("--env-config") + 1]).exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=example_id)
def test_yaml_starts_with_its_command_and_holds_no_secret(path):
    relative = path.relative_to(REPO_ROOT)
    assert path.read_text().splitlines()[0].startswith(f"# python launcher.py --conf {relative} ")
    assert not SECRET.search(path.read_text())


def dry_run(path: Path, flag: str = "--dry-run") -> subprocess.CompletedProcess:
    """`bash <script> --dry-run` (or `--plan`), as a user runs it: a fresh process through the script and the
    launcher."""
    return subprocess.run(["bash", str(path), flag], capture_output=True, text=True, timeout=120)


ENTRY_DRY_RUN_SCRIPT = REPO_ROOT / "examples" / "babyai" / "run_babyai.sh"
"""The script whose dry run also starts the training entry in a fresh process (the full run only)."""


@pytest.fixture(scope="module")
def script_dry_runs(fast_loop: bool) -> dict[Path, subprocess.CompletedProcess]:
    """Every example script run as a user runs it, two at a time, with `--plan` (the launcher's plan: services,
    training command; no entry process): each script's config is composed and checked in this process instead
    (`test_training_overrides_compose_with_the_recipe_config`, the same `check_config` the entry runs). The full run
    also dry-runs one script through a fresh entry process (script -> launcher -> entry -> checks: ~10 s of a
    core, most of it importing verl, which every script would repeat for the same code path); the launcher's
    tests dry-run three more configs that way (tests/launcher/test_launcher_on_cpu.py)."""
    def flag(path: Path) -> str:
        return "--dry-run" if path == ENTRY_DRY_RUN_SCRIPT and not fast_loop else "--plan"

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SCRIPTS, pool.map(lambda path: dry_run(path, flag(path)), SCRIPTS)))


@pytest.mark.timeout(900)  # the first one waits for the fixture: all the scripts' runs
@pytest.mark.parametrize("path", SCRIPTS, ids=example_id)
def test_script_starts_with_its_command_and_dry_runs(path, script_dry_runs, fast_loop):
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash" and lines[1].startswith(f"# bash {path.relative_to(REPO_ROOT)}")
    result = script_dry_runs[path]
    assert result.returncode == 0, result.stderr
    assert re.search(r"^would start (envservice|appworld): ", result.stdout, re.M), result.stdout
    assert "training command: " in result.stdout
    if path != ENTRY_DRY_RUN_SCRIPT or fast_loop:  # run with --plan
        assert "training config: not checked (--plan;" in result.stdout, result.stdout
        assert path in HYDRA_SCRIPTS, "its config is checked in-process by test_training_overrides_compose_..."
        return
    # The entry composed the config with the script's overrides and ran its checks (ours and verl's).
    assert re.search(r"^training config: \S+ composes it and it passes its checks", result.stdout, re.M), \
        result.stdout


RECIPE_CONFIGS = {"recipe.multiturn_rl.main": ("recipe/multiturn_rl/config", "beyond_agent_trainer"),
                  "recipe.sft.main": ("recipe/sft/config", "sft"),
                  "recipe.dpo.main": ("recipe/dpo/config", "dpo"),
                  "recipe.agent_r.main": ("recipe/agent_r/config", "agent_r")}
"""The Hydra config folder and name each training module composes."""
VALUES = {"python": "python", "repo": str(REPO_ROOT), "env_url": "http://x:1"}


def compose_example(path: Path, experiment_dir: Path):
    """The recipe config the example's training command composes (its experiment folder: `experiment_dir`)."""
    config = load_config(path, experiment_dir / "no.env")
    command = train_command(config.train, {**VALUES, "experiment_dir": str(experiment_dir)}, [], token=False)
    overrides = [arg for arg in command[3:] if not arg.startswith(("--config", "hydra.", "beyond_agent.env."))
                 or config.train.module == "recipe.multiturn_rl.main"]
    config_dir, config_name = RECIPE_CONFIGS[config.train.module]
    with initialize_config_dir(config_dir=str(REPO_ROOT / config_dir), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


HYDRA_EXAMPLES = [path for path in EXAMPLES if not load_config(path, Path("/nonexistent.env")).train.command]
HYDRA_SCRIPTS = [path for path in SCRIPTS
                 if REPO_ROOT / re.search(r"--conf (\S+)", path.read_text()).group(1) in HYDRA_EXAMPLES]
"""The scripts whose YAML the in-process compose test checks."""


@pytest.mark.parametrize("path", HYDRA_EXAMPLES, ids=example_id)
def test_training_overrides_compose_with_the_recipe_config(path, tmp_path):
    """Every key the example sets exists in its recipe's config; for RL, our `beyond_agent:` section is valid; an
    explore -> SFT loop's config passes the loop's own checks."""
    composed = compose_example(path, tmp_path)
    module = load_config(path, tmp_path / "no.env").train.module
    if module == "recipe.multiturn_rl.main":
        assert composed.beyond_agent.env.url == "http://x:1"
        BeyondAgentConfig.from_config(composed)
        check_config(composed)  # what the entry checks before Ray starts: ours, the delta seams, verl's validate_config
    elif module == "recipe.agent_r.main":  # what its main checks before any model starts
        from recipe.agent_r.main import checked_config

        checked = checked_config(composed)
        assert checked.out == tmp_path and checked.tasks == tuple(range(64))
    else:  # SFT / DPO on trajectories: our dataset is verl's custom dataset class, the model goes to the folder
        assert composed.data.custom_cls.path.startswith("pkg://beyond_agent.")
        assert composed.trainer.default_local_dir == str(tmp_path / "checkpoints")


def test_trajectory_examples_name_their_data_and_model(tmp_path, monkeypatch):
    """SFT/DPO examples need only the trajectories after `--`; the model follows MODEL_PATH like the RL ones."""
    monkeypatch.setenv("MODEL_PATH", "/models/mine")
    for name, module in (("frozenlake_sft", "sft"), ("frozenlake_dpo", "dpo")):
        composed = compose_example(REPO_ROOT / f"examples/frozenlake/{name}.yaml", tmp_path)
        assert composed.model.path == "/models/mine" and composed.data.train_files is None
        assert load_config(REPO_ROOT / f"examples/frozenlake/{name}.yaml", tmp_path / "no.env").train.module == \
            f"recipe.{module}.main"
    dpo = compose_example(REPO_ROOT / "examples/frozenlake/frozenlake_dpo.yaml", tmp_path)
    assert dpo.data.micro_batch_size_per_gpu % 2 == 0 and dpo.data.min_reward_margin > 0


M2PO_VARIANTS = {f"{env}/{env}_m2po_{mode}.yaml": (env, mode) for env in ("alfworld", "webshop")
                 for mode in ("full", "delta")}
"""The AgentBench (AstraFlow) seed's recipe per env, with verl's full weight sync or delta sync."""
AGENTBENCH = {"alfworld": {"batch": 128, "rounds": 15}, "webshop": {"batch": 256, "rounds": 10}}


@pytest.mark.parametrize("name", sorted(M2PO_VARIANTS))
def test_m2po_variants_carry_the_agentbench_settings(name, tmp_path, monkeypatch):
    env, mode = M2PO_VARIANTS[name]
    monkeypatch.delenv("MODEL_PATH", raising=False)
    composed = compose_example(REPO_ROOT / "examples" / name, tmp_path)
    actor, rollout = composed.actor_rollout_ref.actor, composed.actor_rollout_ref.rollout
    assert composed.actor_rollout_ref.model.path == "Qwen/Qwen2.5-7B-Instruct"
    assert (composed.trainer.nnodes, composed.trainer.n_gpus_per_node) == (1, 8)
    assert composed.data.train_batch_size == AGENTBENCH[env]["batch"] and composed.data.max_response_length == 16384
    assert actor.policy_loss.loss_mode == "m2po" and actor.policy_loss.m2po_budget == 0.04
    assert actor.use_kl_loss is False and composed.algorithm.use_kl_in_reward is False
    assert actor.optim.lr == 1e-6 and actor.optim.lr_scheduler_type == "constant"
    assert actor.optim.lr_warmup_steps == 0 and actor.optim.lr_warmup_steps_ratio == 0.0
    assert rollout.n == 8 and rollout.free_cache_engine is False and rollout.gpu_memory_utilization <= 0.4
    assert composed.trainer.total_training_steps == 1200 and composed.trainer.test_freq == 10
    section = composed.beyond_agent
    assert section.max_tokens_per_turn == 512 and section.val_max_rounds == 10
    assert section.rounds.type == "fixed" and section.rounds.rounds == AGENTBENCH[env]["rounds"]
    assert section.rollout_mode == "async" and section.async_rollout.max_staleness == 2
    assert section.weight_sync.mode == mode
    if mode == "delta":
        assert section.weight_sync.full_every == 10
    settings = BeyondAgentConfig.from_config(composed)
    assert settings.is_async and settings.async_rollout.max_staleness == 2


def _leaves(node, prefix=""):
    """A nested container as {dotted key: value}."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


@pytest.mark.parametrize("env", sorted(AGENTBENCH))
def test_m2po_full_and_delta_variants_differ_only_in_weight_sync(env, tmp_path):
    paths = {mode: REPO_ROOT / "examples" / env / f"{env}_m2po_{mode}.yaml" for mode in ("full", "delta")}
    launch = {mode: asdict(load_config(path, tmp_path / "no.env")) for mode, path in paths.items()}
    for mode, config in launch.items():
        assert config.pop("experiment_name") == f"{env}_m2po_{mode}"
        config.pop("conf_path"), config["train"].pop("overrides")
    assert launch["full"] == launch["delta"]   # services, envservice, data preparation, train module and env
    composed = {mode: _leaves(OmegaConf.to_container(compose_example(path, tmp_path), resolve=False))
                for mode, path in paths.items()}
    differ = {key for key in composed["full"].keys() | composed["delta"].keys()
              if composed["full"].get(key, "<absent>") != composed["delta"].get(key, "<absent>")}
    assert {key for key in differ if not key.startswith("beyond_agent.weight_sync.")} == {"trainer.experiment_name"}
    assert composed["full"]["beyond_agent.weight_sync.mode"] == "full"
    assert composed["delta"]["beyond_agent.weight_sync.mode"] == "delta"


def test_cpu_async_quickstart_runs_m2po_asynchronously(tmp_path):
    composed = compose_example(REPO_ROOT / "examples/quickstart/cpu_async_m2po.yaml", tmp_path)
    assert composed.actor_rollout_ref.actor.policy_loss.loss_mode == "m2po"
    assert composed.actor_rollout_ref.rollout.free_cache_engine is False
    assert composed.beyond_agent.rollout_mode == "async" and composed.beyond_agent.async_rollout.max_staleness == 2
    assert composed.beyond_agent.weight_sync.mode == "delta" and composed.beyond_agent.weight_sync.full_every == 2
    assert composed.trainer.total_training_steps == 4
    assert load_config(REPO_ROOT / "examples/quickstart/cpu_async_m2po.yaml", tmp_path / "no.env").train.cpu


GPU_SETTINGS = {"actor_rollout_ref.rollout.dtype", "actor_rollout_ref.rollout.gpu_memory_utilization",
                "actor_rollout_ref.rollout.enforce_eager", "actor_rollout_ref.rollout.agent.num_workers",
                "trainer.experiment_name"}


@pytest.mark.parametrize("name, also_differ", [("tiny", set()),
                                               ("async_m2po", {"trainer.total_training_steps", "trainer.save_freq"})])
def test_gpu_quickstarts_are_the_cpu_ones_with_gpu_settings(name, also_differ, tmp_path):
    """tests/gpu runs examples/quickstart/gpu_*.yaml: they must stay the CPU quickstarts, bar the GPU's settings."""
    cpu, gpu = (load_config(REPO_ROOT / f"examples/quickstart/{device}_{name}.yaml", tmp_path / "no.env").train
                for device in ("cpu", "gpu"))
    assert cpu.cpu and not gpu.cpu
    cpu_values, gpu_values = (dict(override.split("=", 1) for override in train.overrides) for train in (cpu, gpu))
    differ = {key for key in cpu_values.keys() | gpu_values.keys() if cpu_values.get(key) != gpu_values.get(key)}
    assert differ == GPU_SETTINGS | also_differ
    assert gpu_values["actor_rollout_ref.rollout.dtype"] == "bfloat16"
