"""ParallelEnvManager + EpisodeLoop against a real envservice over loopback, with a scripted policy.

The policy stands in for the LLM: it returns token ids (the tiny tokenizer's encoding of an action plus
the end-of-turn token) and log-probs, like a server would. The real-vLLM run is in
test_rollout_with_vllm_on_cpu.py; here the policy is scripted so outcomes are known exactly.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict

import pytest

from envservice import registry
from envservice.client import EnvClient
from envservice.envs.base import Task, TextEnv
from envservice.envs.frozenlake import FrozenLakeEnv, generate_map, shortest_path_actions
from envservice.server import EnvServiceConfig, create_app
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.batch import training_batch, untrainable
from beyond_agent.rollout.env_manager import ParallelEnvManager
from beyond_agent.rollout.llm import GenerationResult, LLMError, request_seed
from beyond_agent.tasks import AgentTask, EnvTask, StepRewardTask

pytestmark = pytest.mark.timeout(300)
LOGPROB = -0.5


class CrashOnSecondStepEnv(TextEnv):
    """Test env: the second step raises inside the environment."""

    description = "test env: crashes on its second step"
    splits = {"train": ["only"]}

    def reset(self, task: Task):
        self.steps = 0
        return "press the button", {}

    def step(self, action: str):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("simulated crash inside the env")
        return "pressed", 0.0, False, False, {}

    def evaluate(self):
        return 0.0, False


@pytest.fixture(scope="module")
def service_url(serve_app):
    """envservice (frozenlake, frozenlake cut by the service after 2 steps, the crashing test env) served by uvicorn
    in a thread on loopback."""
    registry.register("crash_on_second_step", CrashOnSecondStepEnv, max_steps=50, max_sessions=64)
    registry.register("frozenlake_2_steps", FrozenLakeEnv, max_steps=2, max_sessions=64)
    try:
        with serve_app(create_app(EnvServiceConfig(env_ids=["frozenlake", "frozenlake_2_steps", "crash_on_second_step"],
                                           max_sessions=256))) as url:
            yield url
    finally:
        registry.unregister("crash_on_second_step")
        registry.unregister("frozenlake_2_steps")


@pytest.fixture
def env_client(service_url):
    with EnvClient(service_url, timeout=10, retries=0) as client:
        yield client
    # Every episode released its session, whatever its ending.
    with EnvClient(service_url) as probe:
        assert probe.health().sessions == 0


class ScriptedPolicy:
    """Answers each episode (keyed by its request id) with the next action of a script, as token ids."""

    def __init__(self, tokenizer, script_for, delay_s: float = 0.0, fail_groups: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.script_for = script_for  # request_id -> list of action strings
        self.delay_s = delay_s
        self.fail_groups = fail_groups
        self.turns: dict[str, int] = defaultdict(int)
        self.sampled: dict[str, list[list[int]]] = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        time.sleep(self.delay_s)
        if request_id.split("-")[0] in self.fail_groups:
            raise LLMError("connection", "server went away (scripted)")
        with self.lock:
            turn = self.turns[request_id]
            self.turns[request_id] += 1
        script = self.script_for(request_id)
        action = script[min(turn, len(script) - 1)]
        ids = (self.tokenizer.encode(action, add_special_tokens=False) + [self.tokenizer.eos_token_id])[:max_tokens]
        with self.lock:
            self.sampled[request_id].append(ids)
        return GenerationResult(token_ids=ids, logprobs=[LOGPROB] * len(ids), stop_reason="stop", latency_s=0.0)


def frozenlake_oracle(request_id: str) -> list[str]:
    map_index = int(request_id.split("-")[0].removeprefix("map"))
    return shortest_path_actions(generate_map(Task(split="train", index=map_index, name="", seed=0)))


ROUNDS = 20
"""The round limit where a test does not set its own."""


def make_manager(env_client, tokenizer, policy, **config) -> ParallelEnvManager:
    limits = dict(max_prompt_length=512, max_response_length=1024, max_tokens_per_turn=16)
    return ParallelEnvManager(env_client, policy, tokenizer, EpisodeConfig(**{**limits, **config}), max_workers=8)


def frozenlake_specs(maps: list[int], n: int) -> list[EpisodeSpec]:
    return [EpisodeSpec("frozenlake", task_id=m, seed=0, group_id=f"map{m}", index=i * n + k)
            for i, m in enumerate(maps) for k in range(n)]


def test_oracle_solves_frozenlake_and_tokens_are_the_sampled_ids_and_the_rendered_chat(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, frozenlake_oracle)
    output = make_manager(env_client, chatml_tokenizer, policy).run(frozenlake_specs([0, 1, 5], n=2), max_rounds=ROUNDS)

    assert [r.termination for r in output.results] == ["done"] * 6
    assert all(r.success and r.reward == 1.0 for r in output.results)
    assert output.metrics.success_rate == 1.0 and output.metrics.terminations == {"done": 6}
    for result in output.results:
        episode = result.episode
        assert result.rounds == len(frozenlake_oracle(result.spec.group_id))
        # Mask 1 selects exactly the ids the policy sampled, in order, and nothing else.
        trained = [t for t, m in zip(episode.response_ids, episode.response_mask) if m == 1]
        sampled = [ids for rid, turns in policy.sampled.items() if rid.startswith(f"{result.spec.group_id}-{result.spec.index}-") for ids in turns]
        assert trained == [t for ids in sampled for t in ids]
        assert {lp for lp, m in zip(episode.response_logprobs, episode.response_mask) if m} == {LOGPROB}
        # The whole sequence is the chat template's rendering of the episode's chat.
        rendered = chatml_tokenizer.encode(
            chatml_tokenizer.apply_chat_template(result.messages, tokenize=False), add_special_tokens=False)
        sequence = episode.prompt_ids + episode.response_ids
        assert rendered[: len(sequence)] == sequence
        assert chatml_tokenizer.decode(rendered[len(sequence):]) == "\n"  # the template's newline after the last turn


def test_a_seeded_episode_gives_each_turn_its_own_seed_and_an_unseeded_one_asks_for_none(env_client, chatml_tokenizer):
    """Turn k of an episode with a sampling seed samples with request_seed(its seed, k); an episode without one
    calls generate as before, with no seed (a generate function that takes none keeps working)."""
    script = ScriptedPolicy(chatml_tokenizer, frozenlake_oracle)
    options: dict[str, list[dict]] = defaultdict(list)

    def policy(request_id, prompt_ids, max_tokens, **given):
        options[request_id.rsplit("-", 1)[0]].append(given)  # request id: group-index-<random suffix>
        return script(request_id, prompt_ids, max_tokens)

    specs = [dataclasses.replace(spec, sampling_seed=100 + spec.index) for spec in frozenlake_specs([0, 1], n=2)]
    specs.append(EpisodeSpec("frozenlake", task_id=5, seed=0, group_id="map5", index=4))
    output = make_manager(env_client, chatml_tokenizer, policy).run(specs, max_rounds=ROUNDS)

    assert all(r.termination == "done" and r.rounds > 1 for r in output.results)
    seeds = []
    for result in output.results:
        given = options[f"{result.spec.group_id}-{result.spec.index}"]
        if result.spec.sampling_seed is None:
            assert given == [{}] * result.rounds
        else:
            assert given == [{"seed": request_seed(result.spec.sampling_seed, turn)} for turn in range(result.rounds)]
            seeds += [call["seed"] for call in given]
    assert len(set(seeds)) == len(seeds)  # no two turns of the call sample alike, within or across episodes


def test_round_limit_ends_with_max_rounds_and_no_reward(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"])  # from S, "up" hits the edge: stays put
    output = make_manager(env_client, chatml_tokenizer, policy).run(frozenlake_specs([0], n=2), max_rounds=3)
    assert [(r.termination, r.rounds, r.reward) for r in output.results] == [("max_rounds", 3, 0.0)] * 2
    # Three assistant turns, two observations between them: the last observation is never appended.
    assert [m["role"] for m in output.results[0].messages] == ["system", "user"] + ["assistant", "user"] * 2 + ["assistant"]


def test_the_env_s_own_step_limit_ends_with_truncated_not_the_round_limit(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"])
    specs = [EpisodeSpec("frozenlake_2_steps", task_id=0, seed=0, group_id="map0", index=0)]
    result = make_manager(env_client, chatml_tokenizer, policy).run(specs, max_rounds=5).results[0]
    # Regression (#53): the service truncated the episode after its 2 steps; this was reported as the round limit.
    assert (result.termination, result.rounds, result.infra_failure) == ("truncated", 2, False)


def test_unparseable_reply_is_shown_to_the_model_and_not_sent_to_the_env(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: [""])  # an empty reply is not an action
    output = make_manager(env_client, chatml_tokenizer, policy).run(frozenlake_specs([0], n=1), max_rounds=2)
    result = output.results[0]
    assert result.termination == "max_rounds"
    assert result.messages[3]["content"].startswith("Your reply was empty.")
    assert result.refused_turns == 2  # both replies were no action


def test_an_action_the_env_refuses_counts_as_a_refused_turn(env_client, chatml_tokenizer):
    """FrozenLake answers a word that is not a move with `info["invalid"]`; a move into a wall is a legal move."""
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["jump", "left", "left"])
    result = make_manager(env_client, chatml_tokenizer, policy).run(frozenlake_specs([0], n=1), max_rounds=3).results[0]
    assert result.messages[3]["content"].startswith("Invalid action") and result.refused_turns == 1


def test_env_crash_and_llm_failure_end_only_their_episodes_and_are_not_reward(env_client, chatml_tokenizer):
    specs = frozenlake_specs([0, 1], n=2) + [
        EpisodeSpec("crash_on_second_step", task_id=0, group_id="crash", index=4),
        EpisodeSpec("crash_on_second_step", task_id=0, group_id="crash", index=5),
    ]
    def script(rid):
        return ["press"] if rid.startswith("crash") else frozenlake_oracle(rid)
    policy = ScriptedPolicy(chatml_tokenizer, script, fail_groups=("map1",))
    output = make_manager(env_client, chatml_tokenizer, policy).run(specs, max_rounds=ROUNDS)

    assert [r.termination for r in output.results] == ["done", "done", "llm_error", "llm_error", "env_error", "env_error"]
    assert "server went away" in output.results[2].error and "env_error" in output.results[4].error
    assert output.metrics.infra_failures == 4 and output.metrics.success_rate == 1.0
    batch = training_batch(output.results, None, chatml_tokenizer.pad_token_id, 512, 1024, group_based=True)
    assert batch.batch["responses"].shape[0] == 6  # every row comes back, in order (verl's fit() needs them)
    masked_rows = batch.batch["response_mask"].sum(-1).tolist()
    assert [m > 0 for m in masked_rows] == [True, True, False, False, False, False]
    assert batch.batch["rm_scores"].sum(-1).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert untrainable(output.results, batch.batch["response_mask"]) is None  # map 0's two episodes train


def test_a_batch_with_no_token_to_train_says_how_its_episodes_ended(env_client, chatml_tokenizer):
    """Every group has a failure (map 1's LLM calls fail; the crashing env's steps fail): with GRPO nothing of the
    batch trains, and the step's error names the endings and the first error, where verl would only say that the
    response mask is empty."""
    specs = frozenlake_specs([1], n=2) + [EpisodeSpec("crash_on_second_step", task_id=0, group_id="crash", index=2)]
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["press"] if rid.startswith("crash") else
                            frozenlake_oracle(rid), fail_groups=("map1",))
    output = make_manager(env_client, chatml_tokenizer, policy).run(specs, max_rounds=ROUNDS)
    batch = training_batch(output.results, None, chatml_tokenizer.pad_token_id, 512, 1024, group_based=True)
    reason = untrainable(output.results, batch.batch["response_mask"])
    assert reason.startswith("no token of its 3 episodes can be trained on (1 env_error, 2 llm_error;")
    assert "the first error: " in reason and "server went away" in reason


def test_slow_episode_ends_with_timeout(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"], delay_s=0.3)
    output = make_manager(env_client, chatml_tokenizer, policy, episode_timeout_s=0.5).run(
        frozenlake_specs([0], n=1), max_rounds=10)
    assert output.results[0].termination == "timeout" and output.results[0].infra_failure


def test_response_budget_ends_with_length(env_client, chatml_tokenizer):
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"])
    output = make_manager(env_client, chatml_tokenizer, policy, max_response_length=40).run(
        frozenlake_specs([0], n=1), max_rounds=10)
    result = output.results[0]
    assert result.termination == "length" and not result.infra_failure
    assert len(result.episode.response_ids) == 40


def test_response_filled_exactly_by_an_observation_ends_with_length_not_a_zero_token_request(
        env_client, chatml_tokenizer):
    # Regression: a response filled to the last token by an observation asked the LLM for 0 new tokens,
    # which vLLM and transformers refuse, and the episode was wrongly scored as an llm_error.
    probe = make_manager(env_client, chatml_tokenizer, ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"])).run(
        frozenlake_specs([0], n=1), max_rounds=2).results[0].episode
    first_turn = probe.response_mask.index(0)  # "up" + end-of-turn, mask 1
    first_observation = probe.response_mask.index(1, first_turn) - first_turn  # its delta, mask 0
    asked: list[int] = []
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: ["up"])

    def recording_policy(request_id, prompt_ids, max_tokens):
        asked.append(max_tokens)
        return policy(request_id, prompt_ids, max_tokens)

    output = make_manager(env_client, chatml_tokenizer, recording_policy,
                          max_response_length=first_turn + first_observation).run(frozenlake_specs([0], n=1),
                                                                                  max_rounds=10)
    result = output.results[0]
    assert (result.termination, result.rounds, asked) == ("length", 1, [16])
    assert len(result.episode.response_ids) == first_turn + first_observation


class StepPenaltyTask(AgentTask):
    """A user's task: the env's step rewards minus 0.1 per round."""

    def reward(self, outcome):
        return sum(outcome.step_rewards) - 0.1 * outcome.rounds


def test_one_call_mixes_tasks_each_with_its_own_parser_and_reward(env_client, chatml_tokenizer):
    tasks = {"map0": EnvTask(), "map1": StepPenaltyTask(action_format="tagged"), "map5": StepRewardTask()}
    specs = [EpisodeSpec("frozenlake", task_id=int(g[3:]), seed=0, group_id=g, index=i, agent_task=tasks[g])
             for i, g in enumerate(tasks)]

    def script(rid):  # map1's policy wraps its actions in tags: only the tagged parser reads them
        actions = frozenlake_oracle(rid)
        return [f"<action>{a}</action>" for a in actions] if rid.startswith("map1-") else actions

    output = make_manager(env_client, chatml_tokenizer, ScriptedPolicy(chatml_tokenizer, script)).run(specs, max_rounds=ROUNDS)
    results = output.results
    assert [(r.termination, r.success) for r in results] == [("done", True)] * 3
    path1 = len(frozenlake_oracle("map1-"))
    assert [r.reward for r in results] == [1.0, pytest.approx(1.0 - 0.1 * path1), 1.0]
    # Step rewards: one per turn, the env's reward for that turn's action (FrozenLake: 1.0 on the goal).
    assert [r.step_rewards for r in results] == [[0.0] * (r.rounds - 1) + [1.0] for r in results]
    records = [r.to_record() for r in results]
    assert [rec["agent_task"] for rec in records] == ["env", f"{__name__}.StepPenaltyTask", "step_rewards"]
    assert [rec["step_rewards"] for rec in records] == [r.step_rewards for r in results]

    batch = training_batch(results, None, chatml_tokenizer.pad_token_id, 512, 1024, group_based=True).batch
    assert batch["rm_scores"].sum(-1).tolist() == pytest.approx([r.reward for r in results])
    for row, result in enumerate(results):  # each step reward sits on the last token of its turn
        ends = result.episode.turn_ends
        assert len(ends) == result.rounds and batch["response_mask"][row, ends].tolist() == [1] * result.rounds
        assert batch["step_rewards"][row].nonzero().flatten().tolist() == [ends[-1]]
        assert batch["step_rewards"][row, ends[-1]].item() == 1.0


def test_a_task_whose_reward_raises_ends_its_episode_as_a_failure_not_reward(env_client, chatml_tokenizer):
    class BrokenTask(AgentTask):
        def reward(self, outcome):
            raise KeyError("score_v2")

    specs = [EpisodeSpec("frozenlake", task_id=0, seed=0, group_id="map0", index=0, agent_task=BrokenTask()),
             EpisodeSpec("frozenlake", task_id=0, seed=0, group_id="map0", index=1)]
    output = make_manager(env_client, chatml_tokenizer, ScriptedPolicy(chatml_tokenizer, frozenlake_oracle)).run(specs, max_rounds=ROUNDS)
    broken, fine = output.results
    assert broken.infra_failure and broken.reward == 0.0 and "BrokenTask.reward raised KeyError" in broken.error
    assert fine.termination == "done" and fine.reward == 1.0


def test_gigpo_anchors_group_turns_from_one_state_and_credit_each_turn_s_own_tokens(env_client, chatml_tokenizer):
    """Three episodes of one FrozenLake task: two follow the shortest path (the same states turn by turn) and
    reach the goal, one keeps walking into the top edge, which leaves it on S. The anchors are FrozenLake's state
    keys (the agent's cell); the rollout's anchors, turn ends and turn rewards reach the batch, and GiGPO's step
    part credits each turn's own tokens from them."""
    import torch

    from beyond_agent.algorithms.gigpo import GiGPOConfig, add_step_advantages

    path = frozenlake_oracle("map0")
    policy = ScriptedPolicy(chatml_tokenizer, lambda rid: path if not rid.startswith("map0-2-") else ["up"])
    output = make_manager(env_client, chatml_tokenizer, policy).run(frozenlake_specs([0], n=3),
                                                                    max_rounds=len(path) + 1)
    oracle, stuck = output.results[0], output.results[2]
    assert oracle.anchors == output.results[1].anchors and len(oracle.anchors) == len(path)
    # Regression (#53): anchored on the text, the stuck turns ("You moved." and the grid) were another state than
    # S's first observation; the env's state key puts every one of them with the oracles' first turns.
    assert set(stuck.anchors) == {oracle.anchors[0]} and len(set(oracle.anchors)) == len(path)
    assert all(anchor.startswith("key:") for result in output.results for anchor in result.anchors)

    batch = training_batch(output.results, None, chatml_tokenizer.pad_token_id, 512, 1024, group_based=True)
    assert [len(a) for a in batch.non_tensor_batch["anchors"]] == [len(r.step_rewards) for r in output.results]
    assert [tuple(r) for r in batch.non_tensor_batch["turn_rewards"]] == [tuple(r.step_rewards) for r in output.results]
    batch.non_tensor_batch["uid"] = [r.spec.group_id for r in output.results]  # verl's group ids
    batch.batch["advantages"] = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
    figures = add_step_advantages(batch, GiGPOConfig(gamma=0.5, omega=1.0), norm="mean")
    # The goal's reward 1 on the last oracle turn: R_0 = 0.5^(T-1) for both oracles, 0 for every stuck turn. S's
    # group holds both oracles' first turns and every stuck turn; its mean is 2 R_0 / size (mean-only).
    first, size = 0.5 ** (len(path) - 1), 2 + len(stuck.step_rewards)
    mask, advantages = batch.batch["response_mask"], batch.batch["advantages"]
    assert advantages[2][mask[2] > 0].tolist() == pytest.approx([-2 * first / size] * int(mask[2].sum()))
    assert advantages[0, 0].item() == pytest.approx(first - 2 * first / size)
    assert (advantages[mask == 0] == 0).all()  # observations and padding get nothing
    oracle_first_end = batch.non_tensor_batch["turn_ends"][0][0]
    later = advantages[0, oracle_first_end + 1:]  # the oracles' later states are shared by both: equal returns
    assert (later == 0).all() and (advantages[0, : oracle_first_end + 1][mask[0, : oracle_first_end + 1] > 0] > 0).all()
    turns = len(path) * 2 + len(stuck.step_rewards)
    groups = 1 + (len(path) - 1)  # S; the oracles' later cells
    assert figures == pytest.approx({"beyond_agent/gigpo/anchor_groups": groups,
                                     "beyond_agent/gigpo/mean_group_size": turns / groups,
                                     "beyond_agent/gigpo/singleton_fraction": 0.0,
                                     "beyond_agent/gigpo/text_anchor_fraction": 0.0})
