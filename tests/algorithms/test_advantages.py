"""A GRPO-family advantage is a registered function and a config value
(`algorithms.advantages`): one defined here is chosen by `GRPOConfig.advantage` and by
`--config.grpo.advantage`, and computes what its formula says."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops, options
from jaxrlhf.algorithms import advantages, grpo
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.runs import config_base, sections


def _median_baseline(scores, response_mask, cfg, scored):
    """s_i − median of its group (a leave-nothing-out baseline robust to one outlier)."""
    g = cfg.group_size
    groups = scores.reshape(-1, g)
    adv = (groups - jnp.median(groups, axis=1, keepdims=True)).reshape(-1)
    return ops.broadcast_sequence(adv, response_mask)


@pytest.fixture
def median():
    advantages.register_advantage("median", _median_baseline)
    yield "median"
    advantages.ADVANTAGE_ESTIMATORS.pop("median")
    advantages.GROUPED.discard("median")


def test_a_registered_advantage_is_chosen_by_the_config(median):
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=3, num_samples=3), advantage=median)
    scores = np.array([1.0, 5.0, 2.0, 0.0, 0.0, 3.0], np.float32)
    mask = np.array([[1, 1, 0]] * 6, np.float32)
    got = np.asarray(grpo.compute_advantages(jnp.asarray(scores), cfg, jnp.asarray(mask)))
    want = (scores.reshape(2, 3) - np.median(scores.reshape(2, 3), axis=1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(got, want[:, None] * mask, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="compares responses within a group"):  # grouped: G >= 2
        grpo.GRPOConfig(sampling=SamplingConfig(num_samples=1), advantage=median)


def test_the_command_line_takes_a_registered_name_and_lists_them_for_another(median):
    classes = sections.PHASE_SECTIONS["grpo"]
    options.check_values(classes, config_base.grpo(advantage="median"), "grpo.")
    with pytest.raises(ValueError, match=r"^grpo.advantage='nope' is impossible: it must be one of 'grpo', "
                                         r"'dr_grpo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline', 'gdpo', 'median'"):
        options.check_values(classes, config_base.grpo(advantage="nope"), "grpo.")
