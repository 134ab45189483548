"""Health monitor: each failure signature on a synthetic metric stream that triggers it, and a
healthy stream that does not."""

import logging
import math

import numpy as np
import pytest

from jaxrlhf.monitor import HealthMonitor, MonitorConfig, NonFiniteError


def healthy(i, rng=np.random.default_rng(0)):
    return {"kl/seq": 2.0 + 0.1 * rng.standard_normal(), "clipfrac": 0.1, "first/ratio_max": 1.0,
            "first/ratio_min": 1.0, "first/approx_kl": 0.0, "sampler_logp_diff_max": 1e-6,
            "value_loss": 1.0 + 0.1 * rng.standard_normal(), "reward/mean": 0.01 * i,
            "response_length/mean": 50.0 + 0.1 * i, "finite": True}


def run(stream, **cfg):
    mon = HealthMonitor(MonitorConfig(**cfg))
    return [w for i, m in enumerate(stream) for w in mon.check(m, i)]


def codes(warnings):
    return {w.split("]")[0] + "]" for w in warnings}


def test_healthy_run_has_no_warnings():
    assert run([healthy(i) for i in range(50)], kl_target=3.0) == []


def test_kl_far_past_target():
    stream = [dict(healthy(i), **{"kl/seq": 2.0 * 1.2 ** i}) for i in range(20)]  # 2 → 64
    warnings = run(stream, kl_target=3.0)
    assert codes(warnings) == {"[kl]"}
    # first warning where 2·1.2^i > 9 (3 × target 3): i = 9 (2·1.2^9 ≈ 10.3; 2·1.2^8 ≈ 8.6)
    assert warnings[0].startswith("[kl] step 9:")
    assert run(stream[:9], kl_target=3.0) == []
    assert run(stream, kl_target=None) == []  # no target, no KL check


def test_clipfrac_high_for_many_steps():
    stream = [dict(healthy(i), clipfrac=0.5) for i in range(12)]
    warnings = run(stream, clipfrac_patience=5)
    assert codes(warnings) == {"[clipfrac]"}
    assert [w.split(":")[0] for w in warnings] == ["[clipfrac] step 4", "[clipfrac] step 9"]
    # high now and then, never 5 in a row: silent
    flicker = [dict(healthy(i), clipfrac=0.5 if i % 4 else 0.05) for i in range(40)]
    assert run(flicker, clipfrac_patience=5) == []


@pytest.mark.parametrize("bad", [{"first/ratio_max": 3.5}, {"first/ratio_min": 0.2},
                                 {"first/approx_kl": 0.05}])
def test_ratio_far_outside_clip_range_at_first_minibatch(bad):
    stream = [healthy(0), dict(healthy(1), **bad)]
    warnings = run(stream, clip=0.2)
    assert codes(warnings) == {"[first_ratio]"} and warnings[0].startswith("[first_ratio] step 1")
    # a ratio of 2.5 *later* in the epochs is normal: only the first minibatch is checked
    assert run([dict(healthy(0), ratio_max=2.5, **{"first/ratio_max": 1.0})]) == []
    # ratio 1.5 at the first minibatch is inside [1/3, 3] for ε = 0.2
    assert run([dict(healthy(0), **{"first/ratio_max": 1.5, "first/ratio_min": 0.7})]) == []


def test_sampler_logp_mismatch():
    assert codes(run([dict(healthy(0), sampler_logp_diff_max=3.0)])) == {"[sampler_logp]"}


def test_sampler_policy_drifting_from_the_trained_one():
    """`mismatch_kl` (the off-policy correction's KL(μ ‖ π_prox)) past its bound warns, at
    the first step past it; just under it does not."""
    stream = [dict(healthy(0), mismatch_kl=0.01), dict(healthy(1), mismatch_kl=0.049), dict(healthy(2), mismatch_kl=0.2)]
    warnings = run(stream)
    assert codes(warnings) == {"[mismatch_kl]"} and warnings[0].startswith("[mismatch_kl] step 2")
    assert run(stream, mismatch_kl_max=0.5) == []


def test_value_loss_exploding():
    stream = [healthy(i) for i in range(10)] + [dict(healthy(10), value_loss=50.0)]
    warnings = run(stream)
    assert codes(warnings) == {"[value_loss]"} and warnings[0].startswith("[value_loss] step 10")
    # a steady, slow rise is not an explosion
    assert run([dict(healthy(i), value_loss=1.0 + 0.2 * i) for i in range(40)]) == []
    # a spike before enough history is not judged
    assert run([healthy(0), dict(healthy(1), value_loss=100.0)]) == []


def test_length_hacking():
    # reward and length both climb: 50 → 95 tokens over 10 steps
    stream = [dict(healthy(i), **{"reward/mean": 0.1 * i, "response_length/mean": 50.0 + 5.0 * i}) for i in range(10)]
    warnings = run(stream, length_window=10, length_growth=0.5)
    # first third mean length 55, last third 90 (+64 % > 50 %), reward 0.1 → 0.8
    assert codes(warnings) == {"[length_hacking]"} and warnings[0].startswith("[length_hacking] step 9")
    # length grows but the reward falls: not length hacking
    falling = [dict(s, **{"reward/mean": -0.1 * i}) for i, s in enumerate(stream)]
    assert run(falling, length_window=10) == []
    # reward rises, length roughly constant: fine
    assert run([dict(healthy(i), **{"reward/mean": 0.1 * i}) for i in range(30)]) == []


@pytest.mark.parametrize("key,value", [("policy_loss", math.nan), ("kl/seq", math.inf), ("finite", False),
                                       ("grad_norm", np.float32("nan"))])
def test_non_finite_raises_before_checkpoint(key, value):
    mon = HealthMonitor()
    mon.check(healthy(0), 0)
    saved = []
    with pytest.raises(NonFiniteError) as err:
        for step in (1, 2):
            mon.check(dict(healthy(step), **{key: value}), step)
            saved.append(step)  # "checkpoint" only after a clean check
    assert saved == [] and err.value.step == 1 and key in str(err.value)


def test_warnings_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.monitor"):
        HealthMonitor().check(dict(healthy(0), **{"first/approx_kl": 1.0}))
    assert any("[first_ratio]" in r.message for r in caplog.records)


def test_missing_metrics_and_non_scalars_are_skipped():
    mon = HealthMonitor(MonitorConfig(kl_target=1.0))
    assert mon.check({"reward/mean": 1.0, "note": "grpo", "hist": np.zeros(3)}) == []


def test_config_validation():
    with pytest.raises(ValueError, match="kl_target"):
        MonitorConfig(kl_target=0.0)
    with pytest.raises(ValueError, match="length_window"):
        MonitorConfig(length_window=2)


def test_each_algorithm_names_its_metrics():
    """`for_algorithm` reads each algorithm's own metric names: the PPO stream of every
    check, renamed to GRPO's names (the KL and the sampler gap; every other metric is named
    alike), triggers the same warnings under the GRPO keys, and under PPO's only the checks
    of the shared names."""
    from jaxrlhf.monitor import METRIC_KEYS

    rename = {METRIC_KEYS["ppo"][k]: METRIC_KEYS["grpo"][k] for k in METRIC_KEYS["ppo"]}
    broken = [dict(healthy(i), **{"kl/seq": 20.0, "clipfrac": 0.5, "first/ratio_max": 5.0,
                                  "sampler_logp_diff_max": 3.0, "value_loss": 1.0 if i < 6 else 100.0,
                                  "reward/mean": 0.1 * i, "response_length/mean": 50.0 * 1.2 ** i})
              for i in range(12)]
    ppo_codes = codes(run(broken, **METRIC_KEYS["ppo"], kl_target=3.0))
    assert ppo_codes == {"[kl]", "[clipfrac]", "[first_ratio]", "[sampler_logp]", "[value_loss]", "[length_hacking]"}
    grpo_stream = [{rename.get(k, k): v for k, v in m.items()} for m in broken]
    mon = HealthMonitor(MonitorConfig.for_algorithm("grpo", kl_target=3.0))
    assert codes([w for i, m in enumerate(grpo_stream) for w in mon.check(m, i)]) == ppo_codes
    # under PPO's names only the checks whose metric both algorithms name alike still fire
    assert rename == {"kl/seq": "kl/mean", "sampler_logp_diff_max": "logp_mismatch"}
    assert codes(run(grpo_stream, kl_target=3.0)) == {"[clipfrac]", "[first_ratio]", "[value_loss]", "[length_hacking]"}
    with pytest.raises(ValueError, match="expected one of"):
        MonitorConfig.for_algorithm("sft")
