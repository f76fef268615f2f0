"""The recipe's YAML states the same defaults as the dataclasses that read it (beyond_agent.sections).

Each default lives once, on a dataclass field; the YAML shows every key with its value so that a user reads
the whole section in one place. This test fails when the two disagree, when the YAML has a key no dataclass
reads, or when a dataclass key is missing from the YAML.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from beyond_agent.sections import from_section, section_defaults, section_keys, subsections
from beyond_agent.rollout.seats import SelfPlayConfig
from beyond_agent.settings import BeyondAgentSectionConfig, BeyondAgentConfig, EnvConfig, TrajectoryDumpConfig
from beyond_agent.tasks import TaskTable

YAML = Path(__file__).resolve().parents[2] / "recipe/multiturn_rl/config/beyond_agent_trainer.yaml"
COMPUTED_IN_YAML = {"beyond_agent.trajectories.dir", "beyond_agent.sampling_seed"}
"""Keys whose YAML value is computed from another key (an interpolation), so not a literal default."""
ALIASES = {"beyond_agent.rounds.steps_scaling_inter"}
"""Keys accepted under another project's name that the YAML shows under ours."""


def yaml_section() -> dict:
    return OmegaConf.to_container(OmegaConf.load(YAML).beyond_agent, resolve=False)


def disagreements(cls: type, values: dict, where: str) -> list[str]:
    """Keys of `values` whose value differs from the default, and keys the YAML or the class lacks; every
    sub-section the same way, against its default in the parent (read from the YAML by the same reader, so
    that `rounds: 8` and the stored `(8,)` agree)."""
    found = [f"{where}.{key}: the YAML has it, {cls.__name__} does not" for key in values if key not in section_keys(cls)]
    found += [f"{where}.{key}: {cls.__name__} has it, the YAML does not" for key in section_keys(cls)
              if key not in values and f"{where}.{key}" not in ALIASES]
    nested = subsections(cls)
    for key, default in section_defaults(cls).items():
        value = values.get(key)
        if f"{where}.{key}" in COMPUTED_IN_YAML or key == "tasks" or key not in values:
            continue
        if key in nested:
            found += disagreements(nested[key], value, f"{where}.{key}")
            read = from_section(nested[key], {name: written for name, written in value.items()
                                              if f"{where}.{key}.{name}" not in COMPUTED_IN_YAML}, f"{where}.{key}")
            found += [f"{where}.{key}.{name}: YAML {getattr(read, name)!r}, {cls.__name__} default "
                      f"{getattr(default, name)!r}" for name in section_keys(nested[key])
                      if f"{where}.{key}.{name}" not in COMPUTED_IN_YAML and getattr(read, name) != getattr(default, name)]
        elif value != default:
            found.append(f"{where}.{key}: YAML {value!r}, {cls.__name__} default {default!r}")
    return found


def test_every_default_of_the_beyond_agent_section_agrees_with_its_dataclass():
    section = yaml_section()
    assert disagreements(BeyondAgentSectionConfig, section, "beyond_agent") == []
    assert disagreements(EnvConfig, section["env"], "beyond_agent.env") == []  # the one without a default


def test_only_the_listed_keys_are_computed_in_the_yaml():
    section = yaml_section()
    interpolated = {f"beyond_agent.{key}.{name}" for key in subsections(BeyondAgentSectionConfig)
                    for name, value in section[key].items() if isinstance(value, str) and "${" in value}
    interpolated |= {f"beyond_agent.{name}" for name, value in section.items() if isinstance(value, str) and "${" in value}
    assert interpolated == COMPUTED_IN_YAML


def test_the_default_task_of_the_yaml_is_the_one_an_absent_section_gives():
    configured = TaskTable.from_config(yaml_section()["tasks"]).tasks["default"]
    absent = TaskTable.from_config(section_defaults(BeyondAgentSectionConfig)["tasks"]).tasks["default"]
    assert type(configured) is type(absent) and type(configured.parser) is type(absent.parser)
    assert (configured.action_format, configured.system_prompt) == (absent.action_format, absent.system_prompt)


def test_the_check_finds_a_drifted_default():
    drifted = {**yaml_section()["trajectories"], "every": 0, "extra": 1}
    assert disagreements(TrajectoryDumpConfig, drifted, "beyond_agent.trajectories") == [
        "beyond_agent.trajectories.extra: the YAML has it, TrajectoryDumpConfig does not",
        "beyond_agent.trajectories.every: YAML 0, TrajectoryDumpConfig default 1"]
    rounds = {**yaml_section()["rounds"], "rounds": 6}
    assert disagreements(BeyondAgentSectionConfig, {**yaml_section(), "rounds": rounds}, "beyond_agent") == [
        "beyond_agent.rounds.rounds: YAML (6,), BeyondAgentSectionConfig default (8,)"]


def test_a_config_that_leaves_every_section_out_reads_as_the_yaml_does():
    minimal = {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}},
               "data": {"max_prompt_length": 256, "max_response_length": 512},
               "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}
    full = {**minimal, "beyond_agent": {**yaml_section(), "trajectories": {**yaml_section()["trajectories"],
                                                                          "dir": "trajectories"},
                                        "sampling_seed": None}}  # the YAML's follows actor_rollout_ref.rollout.seed
    assert BeyondAgentConfig.from_config(minimal).trajectories == BeyondAgentConfig.from_config(full).trajectories
    settings = BeyondAgentConfig.from_config(minimal)
    assert (settings.trajectories.every, settings.weight_sync.mode, settings.async_rollout.max_staleness) == (1, "full", 1)


def test_unknown_keys_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"beyond_agent\.trajectories has unknown key\(s\) \['evry'\]; "
                                         r"valid keys: every, dir, max_per_step"):
        from_section(TrajectoryDumpConfig, {"evry": 2}, "beyond_agent.trajectories")
    with pytest.raises(ValueError, match=r"beyond_agent\.env\.url is required"):
        from_section(EnvConfig, {}, "beyond_agent.env")


def test_self_play_is_read_from_its_section_and_refused_beside_a_users_agent():
    config = {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}, "self_play": {"envs": ["tictactoe"]}},
              "data": {"max_prompt_length": 256, "max_response_length": 512},
              "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}
    settings = BeyondAgentConfig.from_config(config)
    assert settings.self_play.active and settings.self_play == SelfPlayConfig(envs=("tictactoe",), seats=2)
    config["beyond_agent"]["agent"] = {"command": "python my_agent.py"}
    with pytest.raises(ValueError, match="beyond_agent.self_play and beyond_agent.agent cannot be on together"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"].pop("agent")
    config["beyond_agent"]["self_play"] = {"envs": ["tictactoe"], "seats": True}
    with pytest.raises(ValueError, match=r"self_play.seats must be an integer >= 2, got True"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"]["self_play"] = {"envs": "tictactoe"}
    with pytest.raises(ValueError, match=r"self_play.envs must be a list of env ids, got 'tictactoe'"):
        BeyondAgentConfig.from_config(config)
