"""The target-KL stop (beyond_agent/algorithms/target_kl.py): the drift it measures, against hand-worked numbers, on
micro-batches in verl's own no-padding layout (read by verl's `no_padding_2_padding`), and the updates it skips on a
real torch optimizer. Its wiring into verl's actor (the loss and the engine's optimizer step, on the actor worker) is
checked in the LoRA training run (tests/trainer/test_train_cpu_on_cpu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from beyond_agent.algorithms.target_kl import MAX_HALVINGS, METRIC, TargetKLStop, check_target_kl, drift_sum
from beyond_agent.settings import BeyondAgentConfig

LN2 = math.log(2.0)


def test_the_drift_is_k3_over_the_masked_tokens():
    # r = 2: 2 - 1 - ln 2; r = 1: 0; r = 1/2: 1/2 - 1 + ln 2; the masked token (r = e^5) counts for nothing.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    new = old + torch.tensor([[LN2, 0.0, -LN2, 5.0]])
    total, tokens = drift_sum(new, old, torch.tensor([[1, 1, 1, 0]]))
    assert tokens == 3
    assert total == pytest.approx((1 - LN2) + (LN2 - 0.5), abs=1e-6)  # = 0.5 (float32 log-probs)


class OneParameterEngine:
    """The part of verl's training engine the stop uses (the actor's FSDPEngine in a run): one parameter, AdamW."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.tensor(1.0))
        self.optimizer = torch.optim.AdamW([self.weight], lr=0.1, weight_decay=0.0)
        self.steps = 0

    def optimizer_step(self) -> float:
        self.optimizer.step()
        self.steps += 1
        return 1.0

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def get_data_parallel_group(self):
        return None


def micro_batch(engine: OneParameterEngine, log_ratios: list[list[float]]) -> tuple[dict, TensorDict]:
    """Two sequences in verl's no-padding layout (prompts of 2 and 1 tokens, responses of 2 and 3), their old
    log-probs -1, and model log-probs old + log_ratio + (weight - weight.detach()) (so the loss has a gradient)."""
    prompts = [torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
    jagged = lambda parts: torch.nested.as_nested_tensor(parts, layout=torch.jagged)  # noqa: E731
    data = TensorDict({"prompts": jagged(prompts), "responses": jagged(responses),
                       "response_mask": jagged([torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.int64)]),
                       "old_log_probs": jagged([torch.full((2,), -1.0), torch.full((3,), -1.0)])}, batch_size=[2])
    # Token t's log-prob sits at position t - 1 of the flat output (verl shifts it left by one).
    flat = torch.zeros(8)
    flat[1:3] = -1.0 + torch.tensor(log_ratios[0])
    flat[4:7] = -1.0 + torch.tensor(log_ratios[1])
    log_probs = flat + (engine.weight - engine.weight.detach())
    return {"log_probs": log_probs}, data


def policy_loss(model_output: dict, data: TensorDict, dp_group=None):
    return -model_output["log_probs"].sum(), {}


def train_mini_batch(stop: TargetKLStop, engine: OneParameterEngine, log_ratios: list[list[float]]) -> float:
    """One mini-batch as verl's engine trains it: zero the gradients, the loss and its backward, the optimizer step."""
    engine.optimizer_zero_grad()
    model_output, data = micro_batch(engine, log_ratios)
    loss, _ = stop.measure(policy_loss)(model_output=model_output, data=data, dp_group=None)
    loss.backward()
    return stop.guard(engine.optimizer_step)()


def test_updates_stop_once_the_drift_before_one_passes_the_target_and_start_again_next_step():
    engine = OneParameterEngine()
    stop = TargetKLStop(engine, target_kl=0.15)
    still = [[0.0, 0.0], [0.0, 0.0, 0.0]]
    assert train_mini_batch(stop, engine, still) == 1.0 and engine.steps == 1  # drift 0: the update runs
    moved = engine.weight.item()
    assert moved != 1.0
    # Drift before the second update: k3 over [ln 2, 0 | -ln 2, 0, 0] = (1 - ln 2 + ln 2 - 1/2) / 5 = 0.1: runs.
    assert train_mini_batch(stop, engine, [[LN2, 0.0], [-LN2, 0.0, 0.0]]) == 1.0 and engine.steps == 2
    # Before the third: [ln 2, -ln 2 | ln 2, -ln 2, 0] gives 2 (1 - ln 2) + 2 (ln 2 - 1/2) = 1 over 5 tokens, 0.2: past.
    weight = engine.weight.item()
    assert train_mini_batch(stop, engine, [[LN2, -LN2], [LN2, -LN2, 0.0]]) == 0.0
    assert engine.steps == 2 and engine.weight.item() == weight  # no step: AdamW's momentum would have moved it
    assert engine.weight.grad is None or not engine.weight.grad.any()
    assert train_mini_batch(stop, engine, still) == 0.0 and engine.steps == 2  # the rest of the step is skipped
    figures = stop.take()
    assert figures[f"{METRIC}updates"] == 4 and figures[f"{METRIC}updates_skipped"] == 2
    assert figures[f"{METRIC}kl_max"] == pytest.approx(0.2, abs=1e-6)
    # The next step starts afresh.
    assert train_mini_batch(stop, engine, still) == 1.0 and engine.steps == 3
    assert stop.take() == {f"{METRIC}kl_max": 0.0, f"{METRIC}updates": 1.0, f"{METRIC}updates_skipped": 0.0}


def test_a_forward_without_gradients_is_not_measured():
    # verl's log-prob passes (old log-probs, the reference) run the loss under no_grad: no update follows them.
    engine = OneParameterEngine()
    stop = TargetKLStop(engine, target_kl=0.1)
    model_output, data = micro_batch(engine, [[5.0, 5.0], [5.0, 5.0, 5.0]])
    with torch.no_grad():
        stop.measure(policy_loss)(model_output=model_output, data=data, dp_group=None)
    assert train_mini_batch(stop, engine, [[0.0, 0.0], [0.0, 0.0, 0.0]]) == 1.0
    assert stop.take()[f"{METRIC}kl_max"] == 0.0


@pytest.mark.parametrize("bad", [0, -0.05, float("nan"), float("inf"), True, "0.05"])
def test_a_target_that_is_not_a_positive_number_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"beyond_agent\.target_kl=.* choose null \(off\) or a positive number"):
        check_target_kl(bad)
    check_target_kl(None)
    check_target_kl(0.05)


def test_the_run_s_settings_read_the_target_and_refuse_a_bad_one():
    config = {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}, "target_kl": 0.05},
              "data": {"max_prompt_length": 256, "max_response_length": 512},
              "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}
    assert BeyondAgentConfig.from_config(config).target_kl == 0.05
    config["beyond_agent"]["target_kl"] = 0
    with pytest.raises(ValueError, match=r"beyond_agent\.target_kl=0 is not valid"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"]["target_kl"] = 0.05
    config["actor_rollout_ref"]["actor"] = {"strategy": "megatron"}
    with pytest.raises(ValueError, match=r"beyond_agent\.target_kl needs actor_rollout_ref\.actor\.strategy in "
                                         r"fsdp, fsdp2, got 'megatron'"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"].pop("target_kl")
    assert BeyondAgentConfig.from_config(config).target_kl is None  # off unless set (and then any strategy)


# ----- backtracking (beyond_agent.target_kl_backtrack) ---------------------------------------------------------------


class OneParameterModelEngine(OneParameterEngine):
    """An engine whose model gives every response token log-prob -1 + (weight - 1): the batch was sampled at weight 1,
    so each token's log-ratio is the weight's move; verl's `train_batch` and `infer_batch` as the base engine runs
    them (zero the gradients, forward and backward, the optimizer step; a forward pass without gradients)."""

    def model_output(self) -> tuple[dict, TensorDict]:
        _, data = micro_batch(self, [[0.0, 0.0], [0.0, 0.0, 0.0]])
        flat = torch.zeros(8)
        flat[1:3] = flat[4:7] = -1.0
        return {"log_probs": flat + (self.weight - 1.0)}, data

    def train_batch(self, data, loss_function):
        self.optimizer_zero_grad()
        model_output, data = self.model_output()
        loss, _ = loss_function(model_output=model_output, data=data, dp_group=None)
        loss.backward()
        return self.optimizer_step()

    def infer_batch(self, data, loss_function=None):
        with torch.no_grad():
            model_output, data = self.model_output()
            return loss_function(model_output=model_output, data=data, dp_group=None)


def installed(engine: OneParameterModelEngine, target_kl: float) -> TargetKLStop:
    """A backtracking stop put on `engine` as `install` puts it on verl's (the loss measures, the two are wrapped)."""
    stop = TargetKLStop(engine, target_kl, backtrack=True)
    engine.loss = stop.measure(policy_loss)
    engine.optimizer_step = stop.guard(engine.optimizer_step)
    engine.train_batch = stop.bounded(engine.train_batch)
    return stop


def k3(log_ratio: float) -> float:
    return math.exp(log_ratio) - 1.0 - log_ratio


def test_an_update_past_the_target_is_halved_until_within_it_and_ends_the_step():
    # The loss's gradient on the weight is -5 every time, so each AdamW step (lr 0.1) moves the weight by 0.1.
    engine = OneParameterModelEngine()
    stop = installed(engine, target_kl=0.01)
    engine.train_batch(None, engine.loss)
    # After the first update every token's log-ratio is 0.1: k3 = 0.00517, within 0.01: kept whole.
    assert engine.weight.item() == pytest.approx(1.1, abs=1e-6)
    engine.train_batch(None, engine.loss)
    # Before the second the drift is 0.00517 (it runs); after it, 0.2: k3 = 0.0214, past. Halved: 0.15, k3 = 0.0118,
    # still past; halved again: 0.125, k3 = 0.00815, within: kept at a quarter of the update.
    assert engine.weight.item() == pytest.approx(1.125, abs=1e-6)
    engine.train_batch(None, engine.loss)  # the step has stopped: no further update
    assert engine.weight.item() == pytest.approx(1.125, abs=1e-6) and engine.steps == 2
    figures = stop.take()
    assert figures[f"{METRIC}kl_max"] == pytest.approx(k3(0.125), abs=1e-6)  # before the third (skipped) update
    assert figures[f"{METRIC}kl_after_max"] == pytest.approx(k3(0.2), abs=1e-6)
    assert figures[f"{METRIC}kl_kept_max"] == pytest.approx(k3(0.125), abs=1e-6)
    assert (figures[f"{METRIC}halvings"], figures[f"{METRIC}updates_undone"]) == (2.0, 0.0)
    assert (figures[f"{METRIC}updates"], figures[f"{METRIC}updates_skipped"]) == (3.0, 1.0)
    engine.train_batch(None, engine.loss)  # the next step updates again
    assert engine.steps == 3


def test_an_update_still_past_the_target_after_the_last_halving_is_undone():
    engine = OneParameterModelEngine()
    stop = installed(engine, target_kl=1e-5)
    engine.train_batch(None, engine.loss)
    # 0.1 -> 0.05 -> 0.025 -> 0.0125 -> 0.00625 (MAX_HALVINGS = 4): k3 = 1.95e-5, still past 1e-5: undone, exactly.
    assert k3(0.1 / 2 ** MAX_HALVINGS) > 1e-5
    assert engine.weight.item() == 1.0
    figures = stop.take()
    assert (figures[f"{METRIC}halvings"], figures[f"{METRIC}updates_undone"]) == (4.0, 1.0)
    assert figures[f"{METRIC}kl_kept_max"] == 0.0 and figures[f"{METRIC}kl_after_max"] == pytest.approx(k3(0.1))


def test_backtracking_needs_a_target_and_is_a_boolean():
    config = {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}, "target_kl_backtrack": True},
              "data": {"max_prompt_length": 256, "max_response_length": 512},
              "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}
    with pytest.raises(ValueError, match=r"beyond_agent\.target_kl_backtrack=true needs beyond_agent\.target_kl"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"]["target_kl_backtrack"] = "yes"
    config["beyond_agent"]["target_kl"] = 0.05
    with pytest.raises(ValueError, match=r"beyond_agent\.target_kl_backtrack='yes' is not valid; choose true or false"):
        BeyondAgentConfig.from_config(config)
    config["beyond_agent"]["target_kl_backtrack"] = True
    assert BeyondAgentConfig.from_config(config).target_kl_backtrack is True
