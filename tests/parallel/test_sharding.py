"""Sharded parameters, steps, sampling, loading and checkpoints on 8 CPU devices.

The checks live in `_check_8dev.py` and run once, in a subprocess that sets
`--xla_force_host_platform_device_count=8` before jax loads (so the flag never reaches
this process); each test below asserts one check's result.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import run_checks  # noqa: E402

CHECKS = [
    "mesh_shapes", "every_param_sharded", "missing_rule_errors", "indivisible_errors", "bytes_per_device",
    "init_equals_unsharded", "forward_equals_unsharded", "chunked_head_equals_unsharded", "train_step_equals_unsharded",
    "sampler_equals_unsharded", "continuous_equals_unsharded", "checkpoint_restores_into_other_mesh", "hf_load_sharded_equals_whole",
    "scanned_stack_sharded", "splash_shard_map_equals_dense", "gemma2_with_lora_equals_unsharded",
]


# One 8-device process runs every check (about a minute): the full suite's; the quick command
# keeps tests/parallel/test_algorithms_sharded.py for sharded = one device.
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(CHECKS, tmp_path_factory.mktemp("sharding"))


@pytest.mark.parametrize("name", CHECKS)
def test_8_devices(results, name):
    assert name in results, f"{name} did not run (the check process stopped early)"
    r = results[name]
    assert r["ok"], r["detail"]
