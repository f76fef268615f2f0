"""A per_call agent episode's earlier samples as rows of verl's training batch (issue #31), by hand.

Two GRPO groups of two episodes, as verl's `fit()` holds them after joining the rollout with its input rows:
  g0: row 0 (reward 0, one sample), row 1 (reward 1, per_call: two earlier segments);
  g1: row 2 (an llm_error), row 3 (reward 1, per_call: one earlier segment).
`add_segment_rows` must append rows 1's two segments and row 3's one (masked: its group has a failure) and one
pad row to a multiple of 4, each segment row with its episode's input fields and its own tokens; verl's own
GRPO on the grown batch must then give group g0's four samples their hand-worked advantages, and the trainer's
recount (`count_each_episode_once`) each episode's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_rloo_outcome_advantage

from beyond_agent.algorithms.gigpo import (GiGPOConfig, add_step_advantages, compute_gigpo_episode_advantage,
                                           count_each_episode_once)
from beyond_agent.rollout.batch import add_segment_rows, segment_batch, training_batch
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.handler import Episode

PAD = 0


def sample(group: str, row: int, response: list[int], mask: list[int], reward: float, termination: str = "done",
           anchors: tuple[str, ...] = ("start",), step_rewards: tuple[float, ...] = (0.0,)) -> EpisodeResult:
    """One sample (an episode's row or an earlier segment): prompt [row+10], its response and mask."""
    turn_end = max(i for i, m in enumerate(mask) if m) if any(mask) else -1
    episode = Episode(prompt_ids=[row + 10], response_ids=response, response_mask=mask,
                      response_logprobs=[-0.5] * len(response), reward=reward, termination=termination,
                      num_turns=1, step_rewards=list(step_rewards), turn_ends=[turn_end])
    return EpisodeResult(spec=EpisodeSpec(env_id="babyai", group_id=group, index=row), episode=episode,
                         termination=termination, reward=reward, success=reward > 0, anchors=list(anchors),
                         step_rewards=list(step_rewards))


def fit_batch(results: list[EpisodeResult]) -> DataProto:
    """What verl's fit() holds when it calls _balance_batch: its input rows (a tensor of its own, uid,
    data_source) joined with our rollout batch."""
    inputs = DataProto.from_dict(
        tensors={"dummy_tensor": torch.arange(len(results)).unsqueeze(1)},
        non_tensors={"uid": np.array([r.spec.group_id for r in results], dtype=object),
                     "data_source": np.array([f"source-{i}" for i in range(len(results))], dtype=object)})
    return inputs.union(training_batch(results, inputs, PAD, 4, 6, group_based=True))


def episodes() -> list[EpisodeResult]:
    row1 = sample("g0", 1, [5, 6, 7], [1, 1, 0], 1.0, anchors=("s2",), step_rewards=(0.25,))
    row1.earlier_segments = [sample("g0", 1, [21, 22], [1, 1], 1.0, anchors=("s0",), step_rewards=(0.5,)),
                             sample("g0", 1, [31, 32, 33, 34], [1, 0, 1, 1], 1.0, anchors=("s1",))]
    row3 = sample("g1", 3, [8, 9], [1, 1], 1.0)
    row3.earlier_segments = [sample("g1", 3, [41], [1], 1.0)]
    failed = EpisodeResult(spec=EpisodeSpec(env_id="babyai", group_id="g1", index=2), episode=None,
                           termination="llm_error")
    return [sample("g0", 0, [1, 2], [1, 1], 0.0), row1, failed, row3]


def test_earlier_segments_join_their_episodes_group_with_their_own_tokens_and_pads_fill_the_mini_batch():
    results = episodes()
    batch = fit_batch(results)
    added = add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 4, PAD)

    assert added == {"segment_rows": 3, "seat_rows": 0, "pad_rows": 1} and len(batch) == 8
    assert list(batch.non_tensor_batch["uid"]) == ["g0", "g0", "g1", "g1", "g0", "g0", "g1", "pad-0"]
    # A segment row keeps every input field of its episode's row (the verl tensor included)...
    assert list(batch.non_tensor_batch["data_source"][4:7]) == ["source-1", "source-1", "source-3"]
    assert batch.batch["dummy_tensor"][4:7, 0].tolist() == [1, 1, 3]
    # ...and has its own tokens: prompt left-padded to 4, response right-padded to 6.
    assert batch.batch["prompts"][4].tolist() == [PAD, PAD, PAD, 11]
    assert batch.batch["responses"][4].tolist() == [21, 22, PAD, PAD, PAD, PAD]
    assert batch.batch["responses"][5].tolist() == [31, 32, 33, 34, PAD, PAD]
    assert batch.batch["response_mask"][5].tolist() == [1, 0, 1, 1, 0, 0]
    # The episode's reward on each segment's last policy token; its own calls' step rewards and anchors.
    assert batch.batch["rm_scores"][4].tolist() == [0, 1, 0, 0, 0, 0]
    assert batch.batch["rm_scores"][5].tolist() == [0, 0, 0, 1, 0, 0]
    assert batch.batch["step_rewards"][4].tolist() == [0, 0.5, 0, 0, 0, 0]
    assert list(batch.non_tensor_batch["anchors"][4:7]) == [("s0",), ("s1",), ()]
    assert batch.batch["rollout_log_probs"][4].tolist() == [-0.5, -0.5, 0, 0, 0, 0]
    # Row 3's segment is in a group with an llm_error: masked with its episode, no reward; the pad row likewise.
    assert batch.batch["response_mask"][[2, 3, 6, 7]].sum() == 0
    assert batch.batch["rm_scores"][6:].abs().sum() == 0
    assert batch.batch["attention_mask"][7].sum() == 2  # one pad token of prompt, one of response

    # verl's GRPO on the grown batch: g0's scores 0, 1, 1, 1 (mean 0.75, unbiased std 0.5) -> -1.5, +0.5 x 3.
    advantages, _ = compute_grpo_outcome_advantage(batch.batch["rm_scores"], batch.batch["response_mask"],
                                                   batch.non_tensor_batch["uid"])
    first_token = advantages[:, 0].tolist()
    assert np.allclose([first_token[i] for i in (0, 1, 4, 5)], [-1.5, 0.5, 0.5, 0.5])
    assert advantages[[2, 3, 6, 7]].abs().sum() == 0
    # Regression (#53): so counted, row 1's episode weighs three times in g0's mean and std. The trainer then
    # counts each episode once (g0: 0 and 1, mean 0.5, std sqrt(1/2) -> -+sqrt(1/2) on every row of each; g1, whose
    # episode 3 has two rows too, is redone as well: its rows are masked, 0).
    batch.batch["token_level_rewards"], batch.batch["advantages"] = batch.batch["rm_scores"].float(), advantages
    assert count_each_episode_once(batch, "std") == 2
    first_token = batch.batch["advantages"][:, 0].tolist()
    assert np.allclose([first_token[i] for i in (0, 1, 4, 5)], [-np.sqrt(0.5)] + [np.sqrt(0.5)] * 3, atol=1e-5)
    assert batch.batch["advantages"][[2, 3, 6, 7]].abs().sum() == 0


def test_rloo_counts_each_episode_once_against_the_others():
    results = episodes()
    batch = fit_batch(results)
    add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 4, PAD)
    rewards = batch.batch["rm_scores"].float()
    advantages, _ = compute_rloo_outcome_advantage(rewards, batch.batch["response_mask"],
                                                   batch.non_tensor_batch["uid"])
    # verl's RLOO sees g0 as four samples, 0, 1, 1, 1: row 0 gets 0 - 1 = -1, each of row 1's three rows
    # 1 - 2/3 = 1/3 (against the mean of the other three, two of which are its own episode).
    assert advantages[0, 0].item() == pytest.approx(-1.0)
    assert [advantages[row, 0].item() for row in (1, 4, 5)] == pytest.approx([1 / 3] * 3)
    batch.batch["token_level_rewards"], batch.batch["advantages"] = rewards, advantages
    # Regression (#53): counted once, g0 holds episodes 0 and 1: -1 and +1 on every trained token of each.
    assert count_each_episode_once(batch, "std", estimator="rloo") == 2
    advantages, mask = batch.batch["advantages"], batch.batch["response_mask"]
    assert advantages[0][mask[0] > 0].tolist() == [-1.0, -1.0]
    assert [advantages[row][mask[row] > 0].tolist() for row in (1, 4, 5)] == [[1.0, 1.0], [1.0, 1.0], [1.0] * 3]
    assert batch.batch["advantages"][[2, 3, 6, 7]].abs().sum() == 0
    with pytest.raises(ValueError, match="estimator must be one of .*'rloo'.*; got 'opo'"):
        count_each_episode_once(batch, "std", estimator="opo")


def test_gigpo_runs_a_segment_s_returns_to_the_episode_s_end_and_counts_each_episode_once():
    """Group g0 under GiGPO (gamma 1/2, mean-only): row 0 (reward 0; one turn from s1, step reward 0) and row 1's
    episode (reward 1) of three rows: turns from s0 (step reward 0.5), s1 (0) and s2 (0.25), in that order."""
    results = episodes()
    results[0] = sample("g0", 0, [1, 2], [1, 1], 0.0, anchors=("s1",))
    row1 = results[1]
    row1.earlier_segments[0].later_step_rewards = [0.0, 0.25]  # as the gateway sets them (test_command_agent)
    row1.earlier_segments[1].later_step_rewards = [0.25]
    batch = fit_batch(results)
    add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 4, PAD)
    rewards = batch.batch["rm_scores"].float()
    batch.batch["token_level_rewards"] = rewards
    batch.batch["advantages"], _ = compute_gigpo_episode_advantage(rewards, batch.batch["response_mask"],
                                                                   batch.non_tensor_batch["uid"],
                                                                   {"norm_adv_by_std_in_grpo": False})
    # verl's estimator sees g0 as four samples, 0, 1, 1, 1 (mean 0.75): row 0 gets -0.75.
    assert batch.batch["advantages"][0, 0].item() == pytest.approx(-0.75)
    add_step_advantages(batch, GiGPOConfig(gamma=0.5, omega=1.0), norm="mean")
    advantages, mask = batch.batch["advantages"], batch.batch["response_mask"]
    # Regression (#53): A^E counts each episode once: episodes 0 and 1 (mean 0.5) -> -0.5 and +0.5 on all of row 1's
    # rows. s1's step group: row 0's turn (return 0) and row 1's second segment, whose return now runs on to the
    # episode's end: 0 + 0.5 * 0.25 = 0.125 (it was 0) -> -0.0625 and +0.0625. s0 and s2 are alone: 0.
    first = {row: advantages[row][mask[row] > 0].tolist() for row in (0, 1, 4, 5)}
    assert first[0] == pytest.approx([-0.5 - 0.0625] * 2)
    assert first[5] == pytest.approx([0.5 + 0.0625] * 3) and first[4] == pytest.approx([0.5] * 2)
    assert first[1] == pytest.approx([0.5] * 2)


def test_a_cut_per_call_episodes_segments_carry_its_forfeit_and_never_beat_a_loss():
    """Group g0 (#69): row 0 lost at its only turn, from s0 (step reward -1). Row 1's per_call episode stalled at s0
    until a limit cut it: an earlier segment (a turn from s0, reward 0) and its last row (a turn from s0, reward 0
    plus the forfeit F = -1 the rollout added; `forfeit` -1). Both score 0."""
    results = [sample("g0", 0, [1, 2], [1, 1], 0.0, anchors=("s0",), step_rewards=(-1.0,)),
               sample("g0", 1, [5, 6], [1, 1], 0.0, anchors=("s0",), step_rewards=(-1.0,))]
    results[1].forfeit = -1.0
    results[1].earlier_segments = [sample("g0", 1, [21, 22], [1, 1], 0.0, anchors=("s0",))]
    results[1].earlier_segments[0].later_step_rewards = [-1.0]  # as the gateway sets them
    batch = fit_batch(results)
    add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 1, PAD)
    rewards = batch.batch["rm_scores"].float()
    batch.batch["token_level_rewards"] = rewards
    batch.batch["advantages"], _ = compute_gigpo_episode_advantage(rewards, batch.batch["response_mask"],
                                                                   batch.non_tensor_batch["uid"],
                                                                   {"norm_adv_by_std_in_grpo": False})
    add_step_advantages(batch, GiGPOConfig(gamma=0.5, omega=1.0), norm="mean")
    # A^E: 0 and 0 -> 0. (g0, s0): the loss -1, the last row 0 + F = -1, the segment 0 + F = -1 (F whole at every
    # turn): all equal -> 0. Before: the segment's return was 0.5 * -1 = -0.5, above the loss's -1 (+1/3 vs -1/6).
    first = [batch.batch["advantages"][row][0].item() for row in range(3)]
    assert first == pytest.approx([0.0, 0.0, 0.0])
    # The forfeit belongs to the episode: its earlier segment's row carries it too.
    assert list(batch.non_tensor_batch["forfeit"]) == [None, -1.0, -1.0]


def test_nothing_is_added_when_no_agent_rewrote_its_history_and_no_pad_when_the_rows_fit():
    plain = [sample("g0", 0, [1], [1], 0.0), sample("g0", 1, [2], [1], 1.0)]
    assert segment_batch(plain, PAD, 4, 6, group_based=True) is None
    batch = fit_batch(plain)
    assert add_segment_rows(batch, None, 2, PAD) == {"segment_rows": 0, "seat_rows": 0, "pad_rows": 0}
    assert len(batch) == 2
    assert add_segment_rows(batch, None, 4, PAD) == {"segment_rows": 0, "seat_rows": 0, "pad_rows": 2}
    assert len(batch) == 4


def seat(game: EpisodeResult, number: int, response: list[int], score: float) -> EpisodeResult:
    """A game's result for one seat (what SeatedEpisodeLoop returns): the game's spec with the seat set."""
    result = sample(f"{game.spec.group_id}/seat{number}", game.spec.index, response, [1] * len(response), score)
    result.spec.seat = number
    return result


def test_the_other_seats_of_self_play_games_train_in_their_seats_groups():
    """One dataset row g0 played twice as a two-seat game: A (seat 0 wins: scores 1 and 0) and B (a draw: 0.5 and
    0.5); row g1's game failed (an llm_error voids both seats). Each game comes back as its seat 0's result with
    seat 1's in `other_seats` (SelfPlayEpisodeLoop). After `add_segment_rows`, GRPO compares seat 0 of A with seat 0
    of B (1 vs 0.5: +-1/sqrt(2)) and seat 1 of A with seat 1 of B (0 vs 0.5: -+1/sqrt(2)); g1's rows are masked."""
    games = []
    for index, (first, second) in enumerate(((1.0, 0.0), (0.5, 0.5))):
        primary = seat(sample("g0", index, [1], [1], 0.0), 0, [index + 1, 7], first)
        primary.other_seats = [seat(primary, 1, [index + 3], second)]
        primary.spec.group_id, primary.other_seats[0].spec.group_id = "g0/seat0", "g0/seat1"
        games.append(primary)
    failed = EpisodeResult(spec=EpisodeSpec(env_id="tictactoe", group_id="g1/seat0", index=2, seat=0), episode=None,
                           termination="llm_error")
    failed.other_seats = [EpisodeResult(spec=EpisodeSpec(env_id="tictactoe", group_id="g1/seat1", index=2, seat=1),
                                        episode=None, termination="llm_error")]
    results = games + [failed]
    inputs = DataProto.from_dict(tensors={"dummy_tensor": torch.arange(3).unsqueeze(1)},
                                 non_tensors={"uid": np.array(["g0", "g0", "g1"], dtype=object)})
    batch = inputs.union(training_batch(results, inputs, PAD, 4, 6, group_based=True))
    added = add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 2, PAD)
    assert added == {"segment_rows": 0, "seat_rows": 3, "pad_rows": 0} and len(batch) == 6
    assert list(batch.non_tensor_batch["uid"]) == ["g0/seat0", "g0/seat0", "g1/seat0", "g0/seat1", "g0/seat1",
                                                   "g1/seat1"]
    assert list(batch.non_tensor_batch["seat"]) == [0, 0, 0, 1, 1, 1]
    assert batch.batch["responses"][3].tolist() == [3, PAD, PAD, PAD, PAD, PAD]
    assert batch.batch["response_mask"][[2, 5]].sum() == 0 and batch.batch["rm_scores"][[2, 5]].abs().sum() == 0
    advantages, _ = compute_grpo_outcome_advantage(batch.batch["rm_scores"], batch.batch["response_mask"],
                                                   batch.non_tensor_batch["uid"])
    last_token = [advantages[row][batch.batch["response_mask"][row] > 0][-1].item() for row in (0, 1, 3, 4)]
    assert last_token == pytest.approx([2 ** -0.5, -(2 ** -0.5), -(2 ** -0.5), 2 ** -0.5], abs=1e-5)

    results = episodes()
    batch = fit_batch(results)
    assert add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=True), 7, PAD)["pad_rows"] == 0
    assert len(batch) == 7


def test_without_a_group_estimator_only_the_failed_episodes_segments_are_masked():
    results = episodes()
    batch = fit_batch(results)
    add_segment_rows(batch, segment_batch(results, PAD, 4, 6, group_based=False), 1, PAD)
    assert len(batch) == 7 and batch.batch["response_mask"][6].tolist() == [1, 0, 0, 0, 0, 0]
    assert batch.batch["response_mask"][2].sum() == 0  # the llm_error itself
