"""Sharded parameters, steps, sampling, loading and checkpoints on 8 CPU devices.

The checks live in `_check_8dev.py` and run once, in a subprocess that sets
`--xla_force_host_platform_device_count=8` before jax loads (so the flag never reaches
this process); each test below asserts one check's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = [
    "mesh_shapes", "every_param_sharded", "missing_rule_errors", "indivisible_errors", "bytes_per_device",
    "init_equals_unsharded", "forward_equals_unsharded", "train_step_equals_unsharded",
    "sampler_greedy_equals_unsharded", "checkpoint_restores_into_other_mesh", "hf_load_sharded_equals_whole",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_check_8dev.py"), str(out), *CHECKS],
                          env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the 8-device check process died (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", CHECKS)
def test_8_devices(results, name):
    assert name in results, f"{name} did not run (the check process stopped early)"
    r = results[name]
    assert r["ok"], r["detail"]
