"""beyond_agent.seams.trainer: each private helper of verl's RayPPOTrainer that fit() calls runs verl's own helper
and the named hook, in the order the hooks promise (verl's helpers are recorded here in place of the real ones,
which need Ray workers; the end-to-end runs in tests/trainer use the real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from beyond_agent.seams.trainer import TrainerSeams, open_join_point, wrap_update_weights


class Recorded(TrainerSeams):
    """TrainerSeams whose hooks record their calls."""

    def __init__(self):  # verl's __init__ needs a whole run; the seams use nothing it sets
        self.calls = []
        self.metrics = {"beyond_agent/episodes": 4.0}

    def join_rows(self, batch, metrics):
        self.calls.append(("join_rows", list(batch)))
        batch.append("segment row")
        metrics["beyond_agent/agent/segment_rows"] = 1.0

    def after_old_log_prob(self, batch, old_log_prob):
        self.calls.append(("after_old_log_prob", old_log_prob))
        return "behaviour"

    def before_actor_update(self, batch):
        self.calls.append(("before_actor_update", list(batch)))
        batch.append("advantages")
        return {"beyond_agent/gigpo/anchors": 2.0}

    def step_metrics(self):
        metrics, self.metrics = self.metrics, {}
        return metrics

    def after_actor_update(self, output):
        self.calls.append(("after_actor_update", dict(output.meta_info["metrics"])))

    def validation_metrics(self):
        self.calls.append(("validation_metrics",))
        return {"val-aux/beyond_agent/task/lake/rounds": 3.0}

    def after_checkpoint_load(self):
        self.calls.append(("after_checkpoint_load", self.global_steps))


@pytest.fixture
def verl_helpers(monkeypatch):
    """verl's helpers replaced by recorders: {helper: [arguments of each call]}."""
    calls = {}

    def recorder(name, result):
        def helper(self, *args, **kwargs):
            calls.setdefault(name, []).append((list(args[0]) if args and isinstance(args[0], list) else args, kwargs))
            return result() if callable(result) else result
        monkeypatch.setattr(RayPPOTrainer, name, helper)

    def update_output():
        return SimpleNamespace(meta_info={"metrics": {"actor/pg_loss": 0.5}})

    recorder("_balance_batch", None)
    recorder("_validate", lambda: {"val-core/lake/reward/mean@1": 0.25})
    recorder("_compute_old_log_prob", ("recomputed", 0.1))
    recorder("_update_critic", update_output)
    recorder("_update_actor", update_output)

    def load_checkpoint(self):  # verl's sets the step resumed from
        self.global_steps = 2
        calls.setdefault("_load_checkpoint", []).append(())
        return None
    monkeypatch.setattr(RayPPOTrainer, "_load_checkpoint", load_checkpoint)
    return calls


def test_the_join_point_adds_rows_then_reorders_only_when_the_user_asked(verl_helpers):
    trainer, batch, metrics = Recorded(), ["row 0", "row 1"], {}
    trainer._balance_batch(batch, metrics)
    assert trainer.calls == [("join_rows", ["row 0", "row 1"])]
    assert verl_helpers["_balance_batch"] == [(["row 0", "row 1", "segment row"],
                                               {"logging_prefix": "global_seqlen", "keep_minibatch": False})]
    assert metrics == {"beyond_agent/agent/segment_rows": 1.0}
    trainer.reorders_rows = False
    trainer._balance_batch(["row 2"], {})
    assert len(verl_helpers["_balance_batch"]) == 1  # verl's reordering did not run again


def test_the_actor_update_sees_the_hooks_batch_and_logs_their_figures_once(verl_helpers):
    trainer, batch = Recorded(), ["row 0"]
    output = trainer._update_actor(batch)
    assert verl_helpers["_update_actor"] == [(["row 0", "advantages"], {})]  # the hook ran first
    assert output.meta_info["metrics"] == {"actor/pg_loss": 0.5, "beyond_agent/episodes": 4.0,
                                           "beyond_agent/gigpo/anchors": 2.0}
    assert trainer.calls[-1] == ("after_actor_update", output.meta_info["metrics"])
    # The critic updates first when there is one: the step's rollout metrics join the critic's, not the actor's again.
    trainer = Recorded()
    critic = trainer._update_critic(["row 0"])
    actor = trainer._update_actor(["row 0"])
    assert critic.meta_info["metrics"] == {"actor/pg_loss": 0.5, "beyond_agent/episodes": 4.0}
    assert "beyond_agent/episodes" not in actor.meta_info["metrics"]


def test_old_log_probs_and_validation_go_through_their_hooks(verl_helpers):
    trainer = Recorded()
    assert trainer._compute_old_log_prob(["row 0"]) == ("behaviour", 0.1)
    assert ("after_old_log_prob", "recomputed") in trainer.calls
    assert trainer._validate() == {"val-core/lake/reward/mean@1": 0.25, "val-aux/beyond_agent/task/lake/rounds": 3.0}
    # merged: verl's raw lists for its own merging; the metrics are taken (once) but not mixed in.
    assert trainer._validate(merged=True) == {"val-core/lake/reward/mean@1": 0.25}
    assert trainer.calls.count(("validation_metrics",)) == 2


def test_open_join_point_turns_verls_helper_on():
    for trainer in ({"balance_batch": False}, {}):
        config = OmegaConf.create({"trainer": trainer})
        open_join_point(config)
        assert config.trainer.balance_batch is True


def test_wrap_update_weights_replaces_the_sync_on_that_manager_only():
    class Manager:
        def update_weights(self, global_steps=None):
            return {"beyond_agent/weight_sync/full": 1.0, "step": global_steps}

    wrapped, plain = Manager(), Manager()
    wrap_update_weights(wrapped, lambda sync: lambda global_steps=None: {**sync(global_steps), "locked": True})
    assert wrapped.update_weights(3) == {"beyond_agent/weight_sync/full": 1.0, "step": 3, "locked": True}
    assert plain.update_weights(3) == {"beyond_agent/weight_sync/full": 1.0, "step": 3}


def test_the_resume_hook_runs_after_verls_resume(verl_helpers):
    trainer = Recorded()
    assert trainer._load_checkpoint() is None
    assert verl_helpers["_load_checkpoint"] == [()] and trainer.calls == [("after_checkpoint_load", 2)]
