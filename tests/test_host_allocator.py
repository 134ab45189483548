"""`tune_host_allocator`: XLA:CPU reuses its temporaries instead of re-mapping them."""

import json
import os
import subprocess
import sys

import pytest

from jaxrlhf import host_allocator

# Calls a jitted function whose temporaries (two [2048, 2048] float32 matmul outputs, 32 MiB,
# from [2048, 64] operands: 1 GFLOP a call) are far over glibc's default mmap threshold;
# prints the median page faults per call after warm-up (a call may still grow the heap now
# and then, while threads interleave).
_PROBE = """
import json, resource, sys
from jaxrlhf.host_allocator import tune_host_allocator
applied = tune_host_allocator()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) * jnp.tanh(x @ (2 * x).T)))
x = jnp.ones((2048, 64), jnp.float32) * 1e-3
for _ in range(5):
    f(x).block_until_ready()
faults = []
for _ in range(11):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults_per_call": sorted(faults)[len(faults) // 2]}))
"""


def _probe(choice: str) -> dict:
    env = {**os.environ, host_allocator.ENV_VAR: choice}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_temporaries_are_reused_not_refaulted():
    tuned = _probe("reuse")
    if not tuned["applied"]:
        pytest.skip("not glibc: tune_host_allocator applies nothing here")  # documented no-op
    default = _probe("default")
    assert default["applied"] is False
    pages_of_temporaries = 32 * 2**20 // 4096  # 8192
    # Re-mapped every call, the 32 MiB of temporaries fault in page by page; reused, almost none.
    assert tuned["faults_per_call"] < 0.1 * pages_of_temporaries, tuned
    assert tuned["faults_per_call"] < 0.2 * default["faults_per_call"], (tuned, default)


def test_off_unless_asked_for_and_checked(monkeypatch):
    monkeypatch.delenv(host_allocator.ENV_VAR, raising=False)
    assert host_allocator.tune_host_allocator() is False
    monkeypatch.setenv(host_allocator.ENV_VAR, "default")
    assert host_allocator.tune_host_allocator() is False
    monkeypatch.setenv(host_allocator.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="JAXRLHF_HOST_ALLOCATOR='fast'"):
        host_allocator.tune_host_allocator()
    with pytest.raises(ValueError, match="choice='on'"):
        host_allocator.tune_host_allocator("on")
