"""Stopping a phase on a held-out metric and keeping its best parameters (`runs.stopping`).

The loop tests drive `run_phase` with a real (donating) regression step and a fake
evaluation whose `accuracy` rises then falls with the step, and check the parameters the
phase ends with against the ones each evaluation saw.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _toy_phase import ARRAYS, TX, toy_step  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.algorithms import common  # noqa: E402
from jaxrlhf.runs import stopping, train_and_evaluate  # noqa: E402
from jaxrlhf.runs.checkpointing import Checkpointer  # noqa: E402
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, Preempted, run_phase  # noqa: E402
from jaxrlhf.runs.metrics import MetricsWriter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# eval/accuracy of the starting state (0) and at each evaluation step (eval_every=2): best
# at 4, then two worse ones.
ACCURACY = {0: 0.1, 2: 0.2, 4: 0.6, 6: 0.5, 8: 0.4, 10: 0.9, 12: 0.9}


_step = jax.jit(toy_step, donate_argnums=0)  # donated like the phases' steps: the best copy must survive it


def _run(workdir, *, early_stop=None, num_steps=12, should_stop=None, calls=None, seen=None, accuracy=ACCURACY):
    """`run_phase` over 12 steps, evaluating every 2; `seen[step]` = the params each evaluation saw."""
    state = common.TrainState.create({"w": jnp.zeros(3)}, TX)
    batches = ArrayBatches(ARRAYS, data.BatchIterator(40, 8, seed=3))
    writer = MetricsWriter(workdir, tensorboard=False)
    seen = {} if seen is None else seen

    def step_fn(state, batch, rng):
        if calls is not None:
            calls.append(1)
        return _step(state, batch, rng)

    def eval_fn(state):
        step = int(state.step)
        seen[step] = np.asarray(state.params["w"]).copy()
        return {"accuracy": accuracy[step], "reward": 1.0}

    try:
        state, _ = run_phase(
            PhaseConfig("phase", num_steps, log_every=1, eval_every=2, checkpoint_every=100, progress=False),
            workdir=workdir, state=state, step_fn=step_fn, batches=batches, rng=jax.random.key(0), writer=writer,
            eval_fn=eval_fn, should_stop=should_stop, early_stop=early_stop, params_of=lambda s: s.params,
            with_params=lambda s, p: s.replace(params=p))
        return state, seen
    finally:
        writer.close()


def _rule(**kw):
    return stopping.EarlyStop(**dict(dict(metric="accuracy", patience=2, keep_best=True), **kw))


def _rows(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "time/" not in k} for row in rows]


@pytest.mark.parametrize("keep_best", [True, False])
def test_stops_after_patience_and_keeps_the_best_params(tmp_path, keep_best):
    calls, rule = [], _rule(keep_best=keep_best)
    state, seen = _run(tmp_path, early_stop=rule, calls=calls)
    # Best at step 4 (0.6); steps 6 and 8 are worse: stop at 8, a finished phase.
    assert len(calls) == 8 and sorted(seen) == [0, 2, 4, 6, 8]
    assert rule.report() == dict(metric="accuracy", mode="max", best_step=4, best_value=0.6, stopped_early_at=8,
                                 keep_best=keep_best)
    np.testing.assert_array_equal(state.params["w"], seen[4] if keep_best else seen[8])
    assert not np.array_equal(seen[4], seen[8])
    assert int(state.step) == 8  # the optimizer state and step stay the last ones
    last = _rows(tmp_path)[-1]
    assert last["step"] == 8 and last["phase/early_stop/best_step"] == 4 and last["phase/early_stop/best_value"] == 0.6
    ckpt = Checkpointer(tmp_path / "phase")
    assert ckpt.latest_step() == 8
    _, saved, meta = ckpt.restore(state)
    ckpt.close()
    assert meta["stopped_early_at"] == 8 and meta["early_stop"]["best_step"] == 4
    np.testing.assert_array_equal(saved.params["w"], state.params["w"])  # the final checkpoint holds the kept params


def test_a_start_evaluation_the_caller_has_is_not_computed_again(tmp_path):
    """train_and_evaluate hands the table's row before a phase to its rule: step 0 reads it."""
    rule = _rule(patience=2)
    rule.start_evaluation = {"accuracy": 0.7, "reward": 1.0}
    state, seen = _run(tmp_path, early_stop=rule, accuracy={2: 0.6, 4: 0.5})
    assert sorted(seen) == [2, 4] and rule.report()["best_step"] == 0 and rule.stopped_at == 4
    np.testing.assert_array_equal(state.params["w"], np.zeros(3))


def test_a_phase_that_only_hurts_ends_where_it_began(tmp_path):
    rule = _rule(patience=2)
    state, seen = _run(tmp_path, early_stop=rule, accuracy={0: 0.7, 2: 0.6, 4: 0.5})
    assert sorted(seen) == [0, 2, 4] and rule.report()["best_step"] == 0 and rule.stopped_at == 4
    np.testing.assert_array_equal(state.params["w"], np.zeros(3))  # the starting parameters


def test_min_delta_and_min_mode():
    rule = stopping.EarlyStop(metric="loss", mode="min", min_delta=0.1, patience=1)
    assert rule.update(2, {"loss": 1.0}) and not rule.should_stop
    assert not rule.update(4, {"loss": 0.95}) and rule.should_stop  # better, but not by more than 0.1
    assert rule.update(6, {"loss": 0.8}) and (rule.best_step, rule.best_value) == (6, 0.8)
    assert not rule.update(8, {"loss": float("nan")})  # a NaN is never a new best
    with pytest.raises(ValueError, match=r"train.stop_metric='loss' is not among .*\['accuracy'\]"):
        rule.update(10, {"accuracy": 1.0})


def test_off_by_default_changes_nothing(tmp_path):
    config = _load("addition_ppo").get_config("tiny")
    assert stopping.from_config(config) == {}  # stop_metric=None in every config
    state, seen = _run(tmp_path / "off")
    np.testing.assert_array_equal(state.params["w"], seen[12])
    ckpt = Checkpointer(tmp_path / "off" / "phase")
    _, _, meta = ckpt.restore(state)
    ckpt.close()
    assert set(meta) == {"data", "step"} and not (tmp_path / "off" / "phase" / "12" / "best").exists()
    # Watching without patience or keep_best records the best and trains the same.
    watched, _ = _run(tmp_path / "watched", early_stop=_rule(patience=0, keep_best=False))
    np.testing.assert_array_equal(watched.params["w"], state.params["w"])
    off, on = _rows(tmp_path / "off"), _rows(tmp_path / "watched")
    assert off[:-1] == on[:-1] and {k: v for k, v in on[-1].items() if "early_stop" not in k} == off[-1]


@pytest.mark.parametrize("preempt_at", [3, 6])
def test_resume_after_preemption_keeps_the_same_best(tmp_path, preempt_at):
    """Preempted before the best (3) or after it, with later params in the state (6): the
    resumed run stops at the same step with the same best and the same params."""
    full_rule = _rule()
    full, seen = _run(tmp_path / "full", early_stop=full_rule)
    with pytest.raises(Preempted):
        _run(tmp_path / "resumed", early_stop=_rule(), should_stop=lambda step: step == preempt_at)
    rule = _rule()
    resumed, _ = _run(tmp_path / "resumed", early_stop=rule)
    assert rule.report() == full_rule.report()
    np.testing.assert_array_equal(resumed.params["w"], full.params["w"])
    np.testing.assert_array_equal(resumed.params["w"], seen[4])
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "full")


def test_an_early_stopped_phase_is_not_rerun(tmp_path):
    first, seen = _run(tmp_path, early_stop=_rule())
    rows = _rows(tmp_path)
    calls, rule = [], _rule(patience=5)  # even with another patience: the phase is over
    again, _ = _run(tmp_path, early_stop=rule, calls=calls)
    assert calls == [] and _rows(tmp_path) == rows
    np.testing.assert_array_equal(again.params["w"], seen[4])
    assert (rule.best_step, rule.stopped_at) == (4, 8)
    # Without the options it is still a finished phase.
    calls = []
    _run(tmp_path, calls=calls)
    assert calls == []


def _load(name):
    path = REPO / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(name="addition_ppo", **train):
    config = _load(name).get_config("tiny")
    with config.unlocked():
        config.train.update(**train)
    return config


@pytest.mark.parametrize("train, match", [
    (dict(stop_metric="accuracy", eval_every=0), r"train.stop_metric='accuracy' needs .*train.eval_every > 0"),
    (dict(stop_metric="acc"), r"train.stop_metric='acc' is not a metric of the ppo phase's evaluation; it "
                              r"reports accuracy, reward"),
    (dict(stop_metric="eval/accuracy"), r"without the 'eval/' prefix, e.g. 'accuracy'"),
    (dict(stop_metric="accuracy", stop_phases="grpo"), r"train.stop_phases='grpo': 'grpo' is not a phase of this "
                                                       r"run; its phases are sft, reward_model, ppo"),
    (dict(stop_metric="reward", stop_phases="ppo,reward_model"), r"not a metric of the reward_model phase"),
    (dict(keep_best=True), r"train.keep_best=True needs train.stop_metric"),
    (dict(stop_patience=2), r"train.stop_patience=2 needs train.stop_metric"),
    (dict(stop_metric="accuracy", stop_mode="up"), r"train.stop_mode='up'"),
    (dict(stop_metric="accuracy", stop_patience=-1), r"train.stop_patience=-1"),
])
def test_config_errors_name_the_field_before_any_work(tmp_path, train, match):
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(_config(**train), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_config_rules_and_metric_names():
    config = _config(stop_metric="accuracy", stop_patience=2, keep_best=True)
    assert list(stopping.from_config(config)) == ["ppo"]  # the run's own phase, not the SFT warm start
    config = _config(stop_metric="accuracy", stop_phases="sft, reward_model,ppo")
    assert list(stopping.from_config(config)) == ["sft", "reward_model", "ppo"]
    from jaxrlhf.runs.evaluation import SampledEval
    sampled = SampledEval(num_samples=4, ks=(1, 4))
    assert stopping.eval_metric_names(config, "ppo", sampled) == {
        "accuracy", "reward", "mean@4", "pass@1", "pass@4", "maj@1", "maj@4"}
    dpo_config = _config("addition_dpo", stop_metric="pairs/reward_accuracy")
    assert list(stopping.from_config(dpo_config)) == ["dpo"]


def test_pair_metric_names_match_the_eval_steps():
    """`eval_metric_names` of the pair phases is what their eval steps return (less `weight`)."""
    from jaxrlhf.algorithms import dpo, reward_model
    from jaxrlhf.models import ModelConfig, random_init

    policy, params = random_init(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                                             num_heads=2, num_kv_heads=2, head_dim=8))
    rm, rm_params = reward_model.init_from_policy(policy, params, seed=0)
    ids = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    mask = jax.ShapeDtypeStruct((2, 4), jnp.bool_)
    f32 = jax.ShapeDtypeStruct((2,), jnp.float32)
    pairs = {k: (mask if k.endswith("mask") else ids) for k in dpo.PAIR_KEYS}
    rm_cfg = reward_model.RewardModelConfig()
    rm_keys = jax.eval_shape(reward_model.make_eval_step(rm, rm_cfg), rm_params, pairs)
    config = _config("addition_dpo")
    assert set(rm_keys) - {"weight"} == stopping.eval_metric_names(config, "reward_model")
    dcfg = dpo.DPOConfig(beta=config.dpo.beta, loss_type=config.dpo.loss_type)
    d_keys = jax.eval_shape(dpo.make_eval_step(policy, dcfg), params, dict(pairs, **{k: f32 for k in dpo.REF_KEYS}))
    assert {f"pairs/{k}" for k in d_keys} - {"pairs/weight"} == (
        stopping.eval_metric_names(config, "dpo") - {"accuracy", "reward"})


@pytest.mark.heavy  # end to end; the guard: this file in-process
def test_ppo_end_to_end_stops_and_records_it(tmp_path):
    """The tiny PPO config with the options: its held-out accuracy stays flat (a tie is not
    a new best), so PPO stops after 2 evaluations without a new best; the SFT warm start,
    which evaluates too, is not a phase of the rule."""
    config = _config(stop_metric="accuracy", stop_patience=2, keep_best=True)
    with config.unlocked():
        config.ppo.steps = 10
    summary = train_and_evaluate(config, tmp_path)
    report = summary["early_stopping"]["ppo"]
    best, at = report["best_step"], report["stopped_early_at"]
    assert at is not None and at < 10 and best < at and report["keep_best"]
    saved = json.loads((tmp_path / "summary.json").read_text())["early_stopping"]
    assert saved == summary["early_stopping"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ppo_rows = [r for r in rows if any(k.startswith("ppo/") for k in r)]
    assert ppo_rows[-1]["step"] == at and ppo_rows[-1]["ppo/early_stop/best_step"] == best
    assert summary["stages"]["after PPO"]["accuracy"] == report["best_value"]  # the kept params
    sft = Checkpointer(tmp_path / "sft")
    assert sft.latest_step() == config.sft.steps  # the warm start ran in full
    sft.close()
