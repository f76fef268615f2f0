"""A limit cut is a forfeit (issue #69): stalling never beats losing, one-player and seated, under GiGPO and under
GRPO/RLOO's inputs. Real TicTacToe through envservice over loopback, the real EpisodeLoop / SeatedEpisodeLoop with
scripted replies, our batch assembly into verl's DataProto, verl's own estimators and our GiGPO.

The hole the issue found: an empty reply is no action, so the env does not step and the state stays; a game the
round limit cut scored 0 like a loss, but its step returns stayed 0 like a draw's, so from the same state GiGPO
ranked stalling above losing. Every number below is worked by hand in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_rloo_outcome_advantage

from envservice.client import EnvClient
from envservice.server import EnvServiceConfig, create_app
from beyond_agent.algorithms.gigpo import GiGPOConfig, add_step_advantages, compute_gigpo_episode_advantage
from beyond_agent.rollout.batch import add_segment_rows, segment_batch, training_batch
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeLoop, EpisodeSpec
from beyond_agent.rollout.scripted import ScriptedPolicy
from beyond_agent.rollout.seats import FORFEIT, SeatedEpisodeLoop, SelfPlayEpisodeLoop
from beyond_agent.tasks import EnvTask, StepRewardTask

pytestmark = pytest.mark.timeout(120)
LIMITS = EpisodeConfig(max_prompt_length=1024, max_response_length=2048, max_tokens_per_turn=16)
ROUNDS = 5
"""The round limit of the one-player games: the win below takes 4 turns."""
PROMPT, RESPONSE = 1024, 2048


@pytest.fixture(scope="module")
def service_url(serve_app):
    with serve_app(create_app(EnvServiceConfig(env_ids=["tictactoe", "frozenlake"], max_sessions=16))) as url:
        yield url


@pytest.fixture
def client(service_url):
    with EnvClient(service_url, timeout=10, retries=0) as client:
        yield client


def one_player(index: int, task=None, env_id: str = "tictactoe", params=None) -> EpisodeSpec:
    """Position 0 of the empty board (no opening move), O to move, against the scripted `first` opponent (X takes
    the lowest free cell): every episode of group pos0 starts from the same state."""
    return EpisodeSpec(env_id, task_id=0, seed=0, group_id="pos0", index=index,
                       params={"opponent": "first", "opening_moves": 0} if params is None else params,
                       agent_task=task or EnvTask())


WIN = ["[4]", "[8]", "[2]", "[6]"]  # O 4, X 0, O 8, X 1, O 2 (blocks 0-1-2), X 3, O 6: O wins on 2-4-6
LOSS = ["[5]", "[8]", "[7]"]  # O 5, X 0, O 8, X 1, O 7, X 2: X wins on 0-1-2
STALL = [""] * ROUNDS  # empty replies: no action, the env never steps, the round limit cuts the game


def play_one_player(client, tokenizer, task=None):
    """The issue's scenario: a win, a loss and a stall from the same state, one group."""
    return [EpisodeLoop(one_player(i, task), client, ScriptedPolicy(replies, tokenizer), tokenizer, LIMITS,
                        ROUNDS).run() for i, replies in enumerate((WIN, LOSS, STALL))]


def verl_batch(results, uids=None) -> DataProto:
    """What verl's fit() holds: its input rows (uid) joined with our rollout batch, the other seats added."""
    uids = uids or [r.spec.group_id for r in results]
    inputs = DataProto.from_dict(tensors={"row": torch.arange(len(results)).unsqueeze(1)},
                                 non_tensors={"uid": np.array(uids, dtype=object)})
    batch = inputs.union(training_batch(results, inputs, 0, PROMPT, RESPONSE, group_based=True))
    add_segment_rows(batch, segment_batch(results, 0, PROMPT, RESPONSE, group_based=True), 1, 0)
    return batch


def gigpo_turn_advantages(batch: DataProto, gamma: float, norm: str = "std") -> list[list[float]]:
    """verl's estimator seam (A^E) then our step part (A^S), as the trainer runs them; each row's per-turn
    advantage, read off the first trained token of each turn."""
    rewards = batch.batch["rm_scores"].float()
    batch.batch["token_level_rewards"] = rewards
    batch.batch["advantages"], _ = compute_gigpo_episode_advantage(
        rewards, batch.batch["response_mask"], batch.non_tensor_batch["uid"],
        {"norm_adv_by_std_in_grpo": norm == "std"})
    add_step_advantages(batch, GiGPOConfig(gamma=gamma, omega=1.0), norm)
    turns = []
    for row, ends in enumerate(batch.non_tensor_batch["turn_ends"]):
        mask, starts = batch.batch["response_mask"][row], [0, *[end + 1 for end in ends[:-1]]]
        turns.append([batch.batch["advantages"][row][start + int(torch.nonzero(mask[start:])[0])].item()
                      for start in starts])
    return turns


def test_the_issues_scenario_one_player_stalling_ranks_below_losing(client, chatml_tokenizer):
    win, loss, stall = play_one_player(client, chatml_tokenizer)
    turns = gigpo_turn_advantages(verl_batch([win, loss, stall]), gamma=0.95)
    # A^E (std): scores 1, 0, 0: mean 1/3, sample std sqrt(1/3) -> 1.1547, -0.5774, -0.5774.
    # The empty board's anchor group: win turn 0, loss turn 0, the stall's 5 turns (7 turns).
    #   Before (#69): returns 0.95^3 = 0.857375, -0.95^2 = -0.9025, and 0 x 5 (the stall's rewards all 0): mean
    #   -0.006446, sample std 0.508152 -> A^S 1.6999, -1.7634, +0.0127; first-turn A: win 2.8546, loss -2.3407,
    #   stall -0.5647: stalling beat losing by 1.78.
    #   Now: the stall's forfeit counts whole at each of its turns: -1 x 5: mean -0.720732, sample std 0.696828 ->
    #   A^S 2.2647, -0.2608, -0.4008; first-turn A: win 3.4194, loss -0.8382, stall -0.9781.
    assert max(turns[2]) <= turns[1][0]  # every stalled turn from that state ranks below the loss's
    assert [turns[0][0], turns[1][0], turns[2][0]] == pytest.approx([3.4194, -0.8382, -0.9781], abs=1e-4)
    assert turns[2] == pytest.approx([turns[2][0]] * 5)

    assert [r.termination for r in (win, loss, stall)] == ["done", "done", "max_rounds"]
    assert [r.score for r in (win, loss, stall)] == [1.0, 0.0, 0.0]  # the env scores a cut game 0, as a loss
    assert win.step_rewards == [0.0, 0.0, 0.0, 1.0] and loss.step_rewards == [0.0, 0.0, -1.0]
    # The stall: 5 turns, none an action (5 refused), all from the empty board; the cut credits the last with F = -1.
    assert stall.refused_turns == 5 and len(set(stall.anchors)) == 1
    assert win.anchors[0] == loss.anchors[0] == stall.anchors[0]
    assert stall.step_rewards == [0.0, 0.0, 0.0, 0.0, FORFEIT] and stall.forfeit == FORFEIT
    assert stall.episode.step_rewards == stall.step_rewards  # what the batch's turn_rewards are made of
    assert (win.forfeit, loss.forfeit) == (None, None)


@pytest.mark.parametrize("gamma", [0.95, 1.0])
def test_one_player_stalling_never_beats_losing_under_either_gamma(client, chatml_tokenizer, gamma):
    """gamma 1: the loss's first-turn return is -1, the stall's -1 too: equal, so the stall's advantage is not above
    the loss's (before: 0 against -1, above it)."""
    win, loss, stall = play_one_player(client, chatml_tokenizer)
    for norm in ("std", "mean"):
        turns = gigpo_turn_advantages(verl_batch([win, loss, stall]), gamma, norm)
        assert max(turns[2]) <= turns[1][0] + 1e-6 < turns[0][0]


def test_one_player_stalling_earns_no_more_than_losing_for_grpo_and_rloo(client, chatml_tokenizer):
    """GRPO and RLOO read the task's reward. The env's score: a cut game 0, a loss 0 (equal). A task summing the
    step rewards (`step_rewards`): win 1, loss -1, and the stall now -1 (F on its last turn; before: 0, above the
    loss). verl's own estimators on our batch: scores 1, -1, -1 -> GRPO (mean -1/3, std 2/sqrt(3)) 1.1547, -0.5774,
    -0.5774; RLOO 1 - (-1) = 2, -1 - 0 = -1, -1 - 0 = -1."""
    for task, rewards in ((EnvTask(), [1.0, 0.0, 0.0]), (StepRewardTask(), [1.0, -1.0, -1.0])):
        results = play_one_player(client, chatml_tokenizer, task)
        assert [r.reward for r in results] == rewards
        batch = verl_batch(results)
        mask, uid = batch.batch["response_mask"], batch.non_tensor_batch["uid"]
        grpo, _ = compute_grpo_outcome_advantage(batch.batch["rm_scores"], mask, uid)
        rloo, _ = compute_rloo_outcome_advantage(batch.batch["rm_scores"], mask, uid)
        for advantages in (grpo, rloo):
            assert advantages[2, 0] <= advantages[1, 0] < advantages[0, 0]
    assert grpo[:, 0].tolist() == pytest.approx([2 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3)], abs=1e-5)
    assert rloo[:, 0].tolist() == pytest.approx([2.0, -1.0, -1.0])


def test_a_stall_cut_by_the_response_length_forfeits_too(client, chatml_tokenizer):
    """The token budget is a limit like the round limit: 60 response tokens hold a few empty replies and the env's
    answers to them; the episode ends with `length`, its last turn credited with -1 (a summed task: -1, not 0)."""
    config = EpisodeConfig(max_prompt_length=1024, max_response_length=60, max_tokens_per_turn=16)
    stall = EpisodeLoop(one_player(0, StepRewardTask()), client, ScriptedPolicy([""] * 20, chatml_tokenizer),
                        chatml_tokenizer, config, 20).run()
    assert stall.termination == "length" and stall.rounds < 20
    assert stall.step_rewards == [0.0] * (stall.rounds - 1) + [FORFEIT] and stall.reward == FORFEIT


def test_the_forfeit_is_the_envs_declared_value_else_a_games_loss_else_zero(client, chatml_tokenizer):
    """TicTacToe declares its forfeit at create; FrozenLake names no seat and declares none: its cut credits 0, so
    a cut episode there scores like failing, as before, and its step rewards stay the env's."""
    from envservice.envs.two_player import FORFEIT_REWARD
    from beyond_agent.rollout.episode_loop import Forfeit

    created = client.create("tictactoe", 0, 0, "train", {"opponent": "first", "opening_moves": 0})
    client.release(created.session_id)
    assert created.info[FORFEIT_REWARD] == -1.0
    lake = EpisodeLoop(one_player(0, env_id="frozenlake", params={}), client,
                       ScriptedPolicy(["up", "up"], chatml_tokenizer), chatml_tokenizer, LIMITS, 2).run()
    assert lake.termination == "max_rounds" and lake.forfeit == 0.0 and lake.step_rewards == [0.0, 0.0]
    rule = Forfeit()
    assert rule.value == 0.0
    rule.note({"seat": 0})
    assert rule.value == FORFEIT  # a game: its loss
    rule.note({"forfeit_reward": -2.5})
    rule.note({"seat": 1})
    assert rule.value == -2.5  # declared wins over the seat key
    assert rule.credit([]) is None  # no turn to credit
    with pytest.raises(Exception, match=r"info\['forfeit_reward'\] must be a number; got 'lose'") as raised:
        rule.note({"forfeit_reward": "lose"})
    assert raised.value.termination == "env_error"  # the env's fault: the episode ends as an env error, not reward
    rewards = [0.5, 0.25]
    assert rule.credit(rewards) == -2.5 and rewards == [0.5, -2.25]  # added: the turn keeps its real reward


# ---- the seated path ----------------------------------------------------------------------------------------


class Replies:
    """A seat's policy: writes the given replies in turn (ids plus end-of-turn), as the seated tests' do."""

    def __init__(self, tokenizer, replies):
        self.policy = ScriptedPolicy(replies, tokenizer)

    def __call__(self, request_id, prompt_ids, max_tokens, seed=None):
        return self.policy(request_id, prompt_ids, max_tokens)


def self_play(client, tokenizer, seat0, seat1, index, max_rounds=4):
    """One self-play game of row pos0 (empty board, O to move), as SelfPlayEnvManager plays it: seat 0's result
    carrying seat 1's."""
    spec = EpisodeSpec("tictactoe", task_id=0, seed=0, group_id="pos0", index=index,
                       params={"opponent": "none", "opening_moves": 0})
    policies = {0: Replies(tokenizer, seat0), 1: Replies(tokenizer, seat1)}
    return SelfPlayEpisodeLoop(SeatedEpisodeLoop(spec, client, policies, tokenizer, LIMITS, max_rounds)).run()


def test_a_seat_that_stalls_until_the_limit_ranks_below_one_that_loses(client, chatml_tokenizer):
    """Two games of one row, seat 0 opening on cell 0 in both, so seat 1's first state is the same. Game A: seat 1
    plays 3 and 4 and loses (O takes 0, 1, 2). Game B: seat 1 replies empty until its round limit (4): it forfeits,
    seat 0 wins by walkover."""
    lost = self_play(client, chatml_tokenizer, ["[0]", "[1]", "[2]"], ["[3]", "[4]"], 0)
    stalled = self_play(client, chatml_tokenizer, ["[0]"], [""] * 4, 1)
    loser, staller = lost.other_seats[0], stalled.other_seats[0]
    for gamma in (0.95, 1.0):
        turns = gigpo_turn_advantages(verl_batch([lost, stalled], uids=["pos0", "pos0"]), gamma, "mean")
        # Group pos0/seat1, A^E: scores 0 and 0 -> 0. Seat 1's first state: the loss's turn 0 and the stall's 4.
        #   gamma 0.95, before (#69): the stall's -1 was discounted like a step reward: returns -0.95 (loss) and
        #   -0.857375, -0.9025, -0.95, -1 (stall), mean -0.931975: the stall's first turn +0.0746, the loss's -0.0180.
        #   Now: -0.95 and -1 x 4: mean -0.99 -> loss +0.04, stall -0.01 at each turn. gamma 1: -1 and -1 -> 0 and 0.
        assert max(turns[3]) <= turns[2][0]
        expected_loss = 0.04 if gamma == 0.95 else 0.0
        assert turns[2][0] == pytest.approx(expected_loss, abs=1e-6)
        assert turns[3] == pytest.approx([-expected_loss / 4] * 4, abs=1e-6)

    assert (loser.termination, loser.step_rewards) == ("done", [0.0, -1.0])
    assert (staller.termination, staller.step_rewards) == ("max_rounds", [0.0, 0.0, 0.0, -1.0])
    assert staller.anchors == [loser.anchors[0]] * 4
    assert loser.reward == staller.reward == 0.0  # GRPO/RLOO's input: a forfeit scores as the loss does
    assert (loser.forfeit, staller.forfeit) == (None, FORFEIT)
    assert (stalled.step_rewards, stalled.forfeit, stalled.score) == ([1.0], None, 1.0)  # the walkover: no forfeit
    batch = verl_batch([lost, stalled], uids=["pos0", "pos0"])
    assert list(batch.non_tensor_batch["uid"]) == ["pos0/seat0", "pos0/seat0", "pos0/seat1", "pos0/seat1"]
    assert list(batch.non_tensor_batch["forfeit"]) == [None, None, None, FORFEIT]  # the other seat's, in its row


def test_an_agent_behind_the_gateway_that_stalls_until_the_limit_forfeits(client, chatml_tokenizer):
    """The gateway's path (a user's agent, `AgentEpisodeLoop`): an agent that asks the model again and again and
    never moves is cut by the call limit (`max_calls`); the cut forfeits the game like our own loop's stall (its last
    turn's step reward -1, the result's `forfeit` -1), and an agent that moves and loses gets its loss (-1 at its
    last move) with no forfeit. Before, the stall's step rewards stayed 0: above the loss's."""
    from beyond_agent.gateway import Gateway, GatewayConfig
    from beyond_agent.gateway.agents import AgentEpisodeLoop
    from beyond_agent.gateway.server import GatewayServer
    from beyond_agent.rollout.llm import GenerationResult

    class Replies:
        """The model behind the gateway: these replies in turn (then the last again), with log-probs."""

        def __init__(self, replies):
            self.ids = [chatml_tokenizer.encode(reply, add_special_tokens=False) + [chatml_tokenizer.eos_token_id]
                        for reply in replies or ["."]]
            self.calls = 0

        def __call__(self, request_id, prompt_ids, max_tokens, **_):
            ids = self.ids[min(self.calls, len(self.ids) - 1)]
            self.calls += 1
            return GenerationResult(list(ids), [-0.5] * len(ids), "stop", 0.0)

    def asking_only(ctx):
        import openai

        model = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        while True:  # past max_calls the gateway refuses: the agent's error, then a limit the episode reached
            model.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": ctx.env.observation}])

    def moving(ctx):
        import openai

        model = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        while not ctx.env.done:
            reply = model.chat.completions.create(model=ctx.model, messages=[
                {"role": "user", "content": ctx.env.observation}]).choices[0].message.content
            ctx.env.step(reply)

    server = GatewayServer(Gateway(GatewayConfig(max_tokens_per_turn=16, max_calls=ROUNDS), chatml_tokenizer)).start()
    try:
        results = [AgentEpisodeLoop(one_player(index), client, server.gateway, server.url, agent, LIMITS, ROUNDS,
                                    Replies(replies), server.socket_path).run()
                   for index, (agent, replies) in enumerate(((asking_only, ["Let me think."]), (moving, LOSS)))]
    finally:
        server.stop()
    stall, loss = results
    assert stall.termination == "max_calls" and stall.forfeit == FORFEIT and stall.step_rewards[-1] == FORFEIT
    assert sum(stall.step_rewards) == FORFEIT  # the forfeit, counted once
    assert loss.termination == "done" and loss.forfeit is None and loss.step_rewards[-1] == -1.0
    assert stall.reward == loss.reward == 0.0  # the env's score: both lost
