"""GRPO and PPO updates sharded as (fsdp=4, tensor=2) and (data=2, fsdp=4) on 8 CPU devices
equal the single-device update (params, optimizer states, metrics). The PPO critic uses its
own rules (pure FSDP) next to the FSDP+TP actor. Marked slow: six update compilations."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import run_checks  # noqa: E402

CHECKS = ["grpo_update_equals_unsharded", "ppo_update_equals_unsharded"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(CHECKS, tmp_path_factory.mktemp("algorithms"))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKS)
def test_update_matches_single_device(results, name):
    assert name in results, f"{name} did not run (the check process stopped early)"
    assert results[name]["ok"], results[name]["detail"]
