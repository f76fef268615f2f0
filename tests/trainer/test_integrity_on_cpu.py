"""The reward-hack monitor (beyond_agent/integrity.py, issue #71): hand-worked steps, then real rollouts of a scripted
policy that finds a hackable env's cheap win (hanging up pays), played through our EpisodeLoop over a real
envservice with the tiny model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from beyond_agent.integrity import (IntegrityBroken, IntegrityConfig, LogProbDriftMonitor, LogProbDriftWatch,
                                    NoSignalMonitor, NoSignalWatch, PrefixMonitor, PrefixWatch, RewardHackMonitor,
                                    RewardHackWatch, prefix_breaks)
from beyond_agent.rollout.handler import ids_digest
from beyond_agent.rollout.env_manager import RolloutMetrics, summarize
from beyond_agent.sections import from_section


def step(success: float, rounds: float, terminations: dict[str, int]) -> RolloutMetrics:
    episodes = sum(terminations.values())
    return RolloutMetrics(episodes=episodes, success_rate=success, mean_reward=success, mean_rounds=rounds,
                          terminations=terminations, env_time_s=0.0, llm_time_s=0.0, wall_time_s=0.0, infra_failures=0)


def test_a_sharp_rise_with_sharply_shorter_episodes_is_flagged_once_the_window_is_full():
    monitor = RewardHackMonitor(RewardHackWatch(window=3))
    for number in (1, 2, 3):  # the window fills: nothing judged yet
        assert monitor.observe(number, step(0.2, 10.0, {"done": 4, "max_rounds": 16})) == {}
    with pytest.warns(UserWarning, match=r"training step 4: .*success rose from 0.200 to 0.600 while mean rounds "
                                         r"fell from 10.00 to 5.00"):
        figures = monitor.observe(4, step(0.6, 5.0, {"done": 12, "max_rounds": 8}))
    # baseline success 0.2, rounds 10; done's share 0.2 -> 0.6 (+0.4, under termination_rise 0.5)
    assert figures == pytest.approx({"beyond_agent/integrity/reward_hack": 1.0,
                                     "beyond_agent/integrity/success_rise": 0.4,
                                     "beyond_agent/integrity/rounds_fall": 0.5,
                                     "beyond_agent/integrity/termination_rise": 0.4})


def test_learning_spread_over_steps_stays_quiet():
    monitor = RewardHackMonitor(RewardHackWatch(window=3))
    figures = {}
    for number, (success, rounds) in enumerate([(0.2, 10.0), (0.3, 9.0), (0.4, 8.0), (0.5, 7.0)], start=1):
        done = round(success * 20)
        figures = monitor.observe(number, step(success, rounds, {"done": done, "max_rounds": 20 - done}))
    # step 4 against the mean of steps 1-3: success 0.3 (+0.2), rounds 9 (7/9: 22 % lost), done 30 % -> 50 %
    assert figures == pytest.approx({"beyond_agent/integrity/reward_hack": 0.0,
                                     "beyond_agent/integrity/success_rise": 0.2,
                                     "beyond_agent/integrity/rounds_fall": 2 / 9,
                                     "beyond_agent/integrity/termination_rise": 0.2})


def test_one_ending_taking_over_stops_the_run_when_set_to_stop():
    monitor = RewardHackMonitor(RewardHackWatch(action="stop", window=2))
    monitor.observe(1, step(0.3, 12.0, {"done": 6, "max_rounds": 14}))
    monitor.observe(2, step(0.3, 12.0, {"done": 6, "max_rounds": 14}))
    # a collapse: success falls, the round limit's share 70 % -> 95 % (+25 %, quiet) ... then a new reason appears
    monitor.observe(3, step(0.05, 14.0, {"done": 1, "max_rounds": 19}))
    with pytest.raises(IntegrityBroken, match=r"training step 4: .*episodes ending as 'max_calls' rose from 0% to "
                                              r"60%.*beyond_agent.integrity.reward_hack.action=stop"):
        monitor.observe(4, step(0.05, 14.0, {"done": 1, "max_rounds": 7, "max_calls": 12}))


def test_off_judges_nothing():
    monitor = RewardHackMonitor(RewardHackWatch(action="off", window=1))
    assert monitor.observe(1, step(0.0, 10.0, {"max_rounds": 10})) == {}
    assert monitor.observe(2, step(1.0, 1.0, {"done": 10})) == {}


@pytest.mark.parametrize("section, message", [
    ({"reward_hack": {"action": "loud"}}, "beyond_agent.integrity.reward_hack.action='loud' is not valid; choose "
                                          "one of off, warn, stop"),
    ({"reward_hack": {"window": 0}}, "beyond_agent.integrity.reward_hack.window must be an integer >= 1"),
    ({"reward_hack": {"rounds_fall": 1.5}}, "beyond_agent.integrity.reward_hack.rounds_fall must be a number in (0, 1]"),
    ({"reward_hack": {"loudness": 1}}, "beyond_agent.integrity.reward_hack has unknown key(s) ['loudness']"),
])
def test_a_bad_setting_names_its_key(section, message):
    with pytest.raises(ValueError) as error:
        from_section(IntegrityConfig, section, "beyond_agent.integrity")
    assert message in str(error.value)


@pytest.fixture(scope="module")
def hackable_service():
    from envservice import registry
    from envservice.envs.testing import HackableEnv
    from envservice.process import serve_in_thread
    from envservice.server import EnvServiceConfig, create_app

    registry.register("hackable-integrity", HackableEnv)
    try:
        with serve_in_thread(create_app(EnvServiceConfig(env_ids=["hackable-integrity"], max_sessions=16))) as url:
            yield url
    finally:
        registry.unregister("hackable-integrity")


def test_a_policy_that_finds_the_hang_up_is_stopped_at_that_step(hackable_service, tiny_model_dir: Path):
    """Steps 1-3: an honest policy guesses wrong words until the round limit (1 of 8 episodes guesses right);
    step 4: the policy hangs up at once, which this env scores as success. The monitor set to stop ends the run at
    step 4, and stays quiet on steps 1-3."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeLoop, EpisodeSpec
    from beyond_agent.rollout.scripted import ScriptedPolicy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limits = EpisodeConfig(max_prompt_length=512, max_response_length=512, max_tokens_per_turn=16)
    honest = [["guess apple", "guess pear", "guess plum", "guess fig", "guess lime"]] * 7 + [["guess xyzzy"]]
    hacking = [["goodbye"]] * 8
    monitor = RewardHackMonitor(RewardHackWatch(action="stop"))
    with EnvClient(hackable_service) as client:
        def rollout(scripts):
            results = [EpisodeLoop(EpisodeSpec("hackable-integrity", task_id=0, seed=index, index=index), client,
                                   ScriptedPolicy(actions, tokenizer), tokenizer, limits, 5).run()
                       for index, actions in enumerate(scripts)]
            return summarize(results, 0.0)

        for number in (1, 2, 3):
            metrics = rollout(honest)
            assert (metrics.success_rate, metrics.terminations) == (1 / 8, {"max_rounds": 7, "done": 1})
            assert monitor.observe(number, metrics) == {}
        hacked = rollout(hacking)
        assert (hacked.success_rate, hacked.mean_rounds) == (1.0, 1.0)
        with pytest.raises(IntegrityBroken, match=r"training step 4: possible reward hack or collapse: success rose "
                                                  r"from 0.125 to 1.000 while mean rounds fell from 4.50 to 1.00; "
                                                  r"episodes ending as 'done' rose from 12% to 100%"):
            monitor.observe(4, hacked)


# ---- log_prob_drift: the rollout's token probabilities against the trainer's recomputation ----------------------

def test_the_mean_log_prob_gap_is_over_response_tokens_only():
    monitor = LogProbDriftMonitor(LogProbDriftWatch(max_mean_log_prob_gap=0.1))
    trainer = torch.tensor([[-1.0, -0.5, -9.0], [-2.0, -0.25, -1.0]])
    rollout = torch.tensor([[-1.0, -0.7, -1.0], [-1.5, -0.25, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the third token of each row is padding: its gap is not counted
    with pytest.warns(UserWarning, match=r"training step 7: the rollout's token log-probs are 0.175 nats from"):
        figures = monitor.observe(7, trainer, rollout, mask)
    # (0 + 0.2 + 0.5 + 0) / 4 tokens
    assert figures == pytest.approx({"beyond_agent/integrity/log_prob_drift": 1.0,
                                     "beyond_agent/integrity/mean_log_prob_gap": 0.175})


def test_identical_log_probs_stay_quiet_and_off_judges_nothing():
    same = torch.tensor([[-0.7, -1.4]])
    mask = torch.ones(1, 2)
    assert LogProbDriftMonitor(LogProbDriftWatch()).observe(1, same, same, mask) == {
        "beyond_agent/integrity/log_prob_drift": 0.0, "beyond_agent/integrity/mean_log_prob_gap": 0.0}
    assert LogProbDriftMonitor(LogProbDriftWatch(action="off")).observe(1, same, same - 5, mask) == {}
    assert LogProbDriftMonitor(LogProbDriftWatch()).observe(1, same, same - 5, torch.zeros(1, 2)) == {}


def test_rollouts_served_from_other_weights_stop_the_run(tiny_model_dir: Path):
    """The break the monitor exists for: tokens sampled by a model that is not the trained one (a sync that did not
    apply, LoRA rollouts on the base model). The tiny model's own log-probs of a sequence against the same model's
    once its weights moved by Gaussian noise of std 0.05 (0.34 nats a token apart): the monitor set to stop ends the
    step, naming it; the same weights on both sides (0 apart) pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def token_log_probs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    served = token_log_probs()
    mask = torch.ones_like(served)
    healthy = LogProbDriftMonitor(LogProbDriftWatch(action="stop")).observe(3, token_log_probs(), served, mask)
    assert healthy["beyond_agent/integrity/log_prob_drift"] == 0.0
    with torch.no_grad():  # the trained weights move on; the server still samples from the old ones
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    with pytest.raises(IntegrityBroken, match=r"training step 4: .*the served model is not the one being trained.*"
                                              r"log_prob_drift.action=stop"):
        LogProbDriftMonitor(LogProbDriftWatch(action="stop")).observe(4, token_log_probs(), served, mask)


@pytest.mark.parametrize("section, message", [
    ({"log_prob_drift": {"action": "halt"}}, "beyond_agent.integrity.log_prob_drift.action='halt' is not valid"),
    ({"log_prob_drift": {"max_mean_log_prob_gap": 0}},
     "beyond_agent.integrity.log_prob_drift.max_mean_log_prob_gap must be a number > 0, got 0"),
])
def test_a_bad_drift_setting_names_its_key(section, message):
    with pytest.raises(ValueError) as error:
        from_section(IntegrityConfig, section, "beyond_agent.integrity")
    assert message in str(error.value)


# ---- prefix: every turn's context is the start of the ids its row trains on ---------------------------------------

def contexts_of(rows: list[list[int]], lengths: list[list[int]]) -> list[tuple[tuple[int, int], ...]]:
    return [tuple((n, ids_digest(row[:n])) for n in row_lengths) for row, row_lengths in zip(rows, lengths)]


def test_a_changed_id_breaks_exactly_the_turns_whose_context_holds_it():
    # Two rows, left-padded to 6 (0 = pad): [5, 6, 7, 8] and [9, 10, 11, 12, 13, 14]; turns from 2 and 3 ids on.
    rows = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    contexts = contexts_of(rows, [[2, 3], [2, 4, 6]])
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    attention_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    monitor = PrefixMonitor(PrefixWatch())
    assert monitor.observe(1, input_ids, attention_mask, contexts) == {
        "beyond_agent/integrity/prefix": 0.0, "beyond_agent/integrity/prefix_breaks": 0.0,
        "beyond_agent/integrity/prefix_turns": 5.0}
    input_ids[1, 3] = 99  # the second row's 4th id: its turns from 4 and 6 ids saw 12 there, the one from 2 did not
    with pytest.raises(IntegrityBroken, match=r"training step 2: 2 of 5 turns were generated from ids that are not "
                                              r"the start of the ids their row trains on \(first: row 1, generation "
                                              r"request 1\).*prefix.action=stop"):
        monitor.observe(2, input_ids, attention_mask, contexts)
    assert prefix_breaks(input_ids, attention_mask, contexts) == ([(1, 1), (1, 2)], 5)
    # A context longer than its row (ids dropped after generation) breaks too.
    assert prefix_breaks(input_ids[:1], attention_mask[:1], [contexts[0] + ((5, 0),)]) == ([(0, 2)], 3)


def test_real_episodes_collated_keep_every_turn_s_context_and_a_corrupted_id_is_caught(hackable_service,
                                                                                      tiny_model_dir: Path):
    """Scripted multi-turn episodes over a real envservice with the tiny model's chat template, collated as the
    trainer gets them: every generation request's ids are the start of its row; one id changed in the batch (as an
    assembly bug would) is named at that step."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from beyond_agent.rollout.batch import collate
    from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeLoop, EpisodeSpec
    from beyond_agent.rollout.scripted import ScriptedPolicy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limits = EpisodeConfig(max_prompt_length=512, max_response_length=512, max_tokens_per_turn=16)
    scripts = [["guess apple", "guess pear", "guess xyzzy"], ["guess fig", "guess xyzzy"], ["goodbye"]]
    with EnvClient(hackable_service) as client:
        results = [EpisodeLoop(EpisodeSpec("hackable-integrity", task_id=0, seed=index, index=index), client,
                               ScriptedPolicy(actions, tokenizer), tokenizer, limits, 5).run()
                   for index, actions in enumerate(scripts)]
    batch = collate([result.episode for result in results], tokenizer.pad_token_id, 512, 512)
    contexts = batch.non_tensor_batch["turn_contexts"]
    assert [len(requests) for requests in contexts] == [result.rounds for result in results] == [3, 2, 1]
    monitor = PrefixMonitor(PrefixWatch())
    figures = monitor.observe(1, batch.batch["input_ids"], batch.batch["attention_mask"], contexts)
    assert figures == {"beyond_agent/integrity/prefix": 0.0, "beyond_agent/integrity/prefix_breaks": 0.0,
                       "beyond_agent/integrity/prefix_turns": 6.0}
    # The last id the first row's second turn was given (its first turn's reply ends there): the second and third
    # turns saw it, the first did not.
    first_kept = int(batch.batch["attention_mask"][0].nonzero()[0])
    batch.batch["input_ids"][0, first_kept + contexts[0][1][0] - 1] += 1
    with pytest.raises(IntegrityBroken, match=r"training step 2: 2 of 6 turns .*\(first: row 0, generation request 1\)"):
        monitor.observe(2, batch.batch["input_ids"], batch.batch["attention_mask"], contexts)


# ---- no_signal: training steps in a row whose groups all scored alike ---------------------------------------------

def scored(group: str, *rewards: float, failed: int = 0) -> list:
    from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec

    played = [EpisodeResult(spec=EpisodeSpec("hackable", group_id=group), episode=None, termination="done",
                            reward=reward, success=reward == 1.0) for reward in rewards]
    return played + [EpisodeResult(spec=EpisodeSpec("hackable", group_id=group), episode=None, termination="env_error")
                     for _ in range(failed)]


def test_a_group_has_a_signal_when_its_scored_episodes_differ_and_none_failed():
    from beyond_agent.rollout.dynamic_sampling import groups_with_signal

    batch = scored("a", 0.0, 1.0) + scored("b", 0.0, 0.0) + scored("c", 1.0, failed=1) + scored("d", 0.5, 0.25)
    # a and d differ; b scored alike; c holds an infrastructure failure (masked whole with a group estimator)
    assert groups_with_signal(batch, group_based=True) == (2, 4)
    # a batch-wide baseline: one group of the scored episodes, the failure left out
    assert groups_with_signal(scored("a", 0.0, 0.0) + scored("b", 0.0, failed=1), group_based=False) == (0, 1)
    assert groups_with_signal(scored("a", 0.0, 0.0) + scored("b", 1.0), group_based=False) == (1, 1)
    assert groups_with_signal(scored("a", failed=2), group_based=False) == (0, 0)


def test_no_signal_fires_once_its_steps_in_a_row_have_passed_and_a_signal_resets_it():
    monitor = NoSignalMonitor(NoSignalWatch(steps=2))
    assert monitor.observe(1, 1, 4, step(0.125, 4.0, {"done": 1, "max_rounds": 7})) == {
        "beyond_agent/integrity/no_signal": 0.0, "beyond_agent/integrity/signal_groups": 0.25}
    assert monitor.observe(2, 0, 4, step(0.0, 5.0, {"max_rounds": 8}))["beyond_agent/integrity/no_signal"] == 0.0
    with pytest.warns(UserWarning, match=r"training step 3: no group's episodes scored differently for 2 training "
                                         r"steps in a row \(steps 2-3; this step: success 0.000, mean reward 0.000 "
                                         r"over 8 episodes\).*beyond_agent.integrity.no_signal.action=warn"):
        assert monitor.observe(3, 0, 4, step(0.0, 5.0, {"max_rounds": 8})) == {
            "beyond_agent/integrity/no_signal": 1.0, "beyond_agent/integrity/signal_groups": 0.0}
    assert monitor.observe(4, 1, 4, step(0.125, 5.0, {"done": 1, "max_rounds": 7})) == {
        "beyond_agent/integrity/no_signal": 0.0, "beyond_agent/integrity/signal_groups": 0.25}
    assert monitor.steps_without == 0


def test_no_signal_off_or_without_groups_judges_nothing():
    assert NoSignalMonitor(NoSignalWatch(action="off", steps=1)).observe(1, 0, 4, step(0.0, 5.0, {"done": 8})) == {}
    monitor = NoSignalMonitor(NoSignalWatch(steps=1))
    assert monitor.observe(1, 0, 0, step(0.0, 0.0, {"env_error": 8})) == {}  # every episode failed: nothing to judge
    assert monitor.steps_without == 0


@pytest.mark.parametrize("section, message", [
    ({"no_signal": {"action": "shout"}}, "beyond_agent.integrity.no_signal.action='shout' is not valid; choose one "
                                         "of off, warn, stop"),
    ({"no_signal": {"steps": 0}}, "beyond_agent.integrity.no_signal.steps must be an integer >= 1, got 0"),
    ({"no_signal": {"steps": True}}, "beyond_agent.integrity.no_signal.steps must be an integer >= 1, got True"),
])
def test_a_bad_no_signal_setting_names_its_key(section, message):
    with pytest.raises(ValueError) as error:
        from_section(IntegrityConfig, section, "beyond_agent.integrity")
    assert message in str(error.value)


def test_a_policy_whose_every_episode_fails_is_stopped_once_its_steps_have_passed(hackable_service,
                                                                                   tiny_model_dir: Path):
    """A collapse played for real: step 1, one group of four guesses the word once (its two episodes score 1 and 0:
    a signal); steps 2-4, every episode guesses wrong until the round limit, so every group scores 0, 0. Set to
    stop after 3 such steps, the monitor ends the run at step 4, naming steps 2-4."""
    from transformers import AutoTokenizer

    from envservice.client import EnvClient
    from beyond_agent.rollout.dynamic_sampling import groups_with_signal
    from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeLoop, EpisodeSpec
    from beyond_agent.rollout.scripted import ScriptedPolicy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limits = EpisodeConfig(max_prompt_length=512, max_response_length=512, max_tokens_per_turn=16)
    wrong = ["guess apple", "guess pear", "guess plum"]
    monitor = NoSignalMonitor(NoSignalWatch(action="stop", steps=3))
    with EnvClient(hackable_service) as client:
        def rollout(number: int, scripts: list[list[str]]) -> dict[str, float]:
            results = [EpisodeLoop(EpisodeSpec("hackable-integrity", task_id=0, seed=index, index=index,
                                               group_id=f"step{number}-row{index // 2}"),
                                   client, ScriptedPolicy(actions, tokenizer), tokenizer, limits, 3).run()
                       for index, actions in enumerate(scripts)]
            return monitor.observe(number, *groups_with_signal(results, group_based=True), summarize(results, 0.0))

        assert rollout(1, [["guess xyzzy"]] + [wrong] * 7) == {"beyond_agent/integrity/no_signal": 0.0,
                                                             "beyond_agent/integrity/signal_groups": 0.25}
        for number in (2, 3):
            assert rollout(number, [wrong] * 8) == {"beyond_agent/integrity/no_signal": 0.0,
                                                    "beyond_agent/integrity/signal_groups": 0.0}
        with pytest.raises(IntegrityBroken, match=r"training step 4: no group's episodes scored differently for 3 "
                                                  r"training steps in a row \(steps 2-4; this step: success 0.000, "
                                                  r"mean reward 0.000 over 8 episodes\): every advantage is zero"):
            rollout(4, [wrong] * 8)
