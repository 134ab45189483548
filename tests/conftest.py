"""Suite-wide pytest settings: fast-compiling XLA flags (`_xla.py`), and the slowest files
start first.

With `-n 2 --dist loadfile` (pyproject.toml) each file runs whole on one worker, in the
order the files are collected: the few files that take minutes (module fixtures of training
runs, an 8-device check process) came last alphabetically and left one worker idle while
the other finished them (a 16-minute suite with about 4 minutes of one worker alone).
Longest first is the classic fix for that tail. The list is from measured `--durations`
(2 cores, 2026-12-02, per file), longest first; other files keep their order after it.
"""

from __future__ import annotations

import os

import _xla

os.environ["XLA_FLAGS"] = _xla.flags(base=os.environ.get("XLA_FLAGS"))  # before any test imports jax

SLOW_FIRST = (
    "runs/test_configs.py", "runs/test_train_mesh.py", "algorithms/test_dpo.py", "rollout/test_sampler.py",
    "algorithms/test_grpo.py", "notebooks/test_notebooks.py", "models/test_decoding.py", "parallel/test_sharding.py",
    "runs/test_lora_run.py", "algorithms/test_ppo.py", "models/test_attention.py", "algorithms/test_common.py",
    "models/test_families.py", "runs/test_checkpoint_health.py", "parallel/test_algorithms_sharded.py",
    "runs/test_workdir.py", "models/test_scan.py", "algorithms/test_sft.py", "algorithms/test_reward_model.py",
    "runs/test_sampled_eval.py", "runs/test_monitor_cli.py", "runs/test_stop_on_eval.py", "models/test_lora.py",
    "models/test_checkpoint_io.py", "runs/test_python_rewards.py", "ops/test_properties.py",
    # added 2026-12-03 (measured alone: 15-25 s each)
    "runs/test_file_data.py", "runs/test_lora_ppo_run.py", "models/test_lora_dropout.py", "runs/test_qlora_run.py",
    "algorithms/test_kl_placement.py", "algorithms/test_ppo_lora.py", "runs/test_chat_run.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
