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
    "algorithms/test_kl_placement.py", "algorithms/test_ppo_lora.py", "runs/test_chat_run.py", "algorithms/test_guide.py",
    "runs/test_reward_ensemble.py",
)


# Deselected unless `--heavy` is given (`python -m pytest -q -n 2 --heavy tests`: the whole suite,
# ~25 minutes on 2 cores), to keep the default run near its 12-minute budget (an idle run of
# everything took 21 minutes on 2026-12-03). Each entry is an end-to-end run or a further
# parameter of a property whose path a default test already covers; the comment names it.
HEAVY = (
    "runs/test_train_mesh.py::",  # meshes from the command line; sharded = one device: parallel/, test_sampled_eval
    "runs/test_file_data.py::test_sft_then_reward_model_then_ppo_all_from_files",  # each phase from files: this file
    "runs/test_lora_run.py::",  # GRPO with LoRA learning + resume; LoRA steps: models/test_lora.py
    "runs/test_lora_ppo_run.py::",  # LoRA PPO run; the LoRA PPO iteration: algorithms/test_ppo_lora.py
    "runs/test_qlora_run.py::",  # QLoRA run; the quantised base: models/test_quant.py
    "runs/test_configs.py::test_tiny_variant_runs_end_to_end[addition_dpo]",  # runs/test_python_rewards, test_file_data
    "runs/test_configs.py::test_tiny_variant_runs_end_to_end[addition_ppo_rule]",  # [addition_ppo]
    "runs/test_configs.py::test_tiny_variant_runs_end_to_end[addition_reward_model]",  # [addition_ppo]
    "runs/test_configs.py::test_tiny_variant_runs_end_to_end[addition_sft]",  # every run's warm start
    "runs/test_configs.py::test_word_problems_config_runs_on_a_tiny_random_checkpoint",  # the hf config test
    "runs/test_stop_on_eval.py::test_ppo_end_to_end_stops_and_records_it",  # the guard: this file in-process
    "runs/test_reward_folder.py::test_ppo_with_the_task_reward_and_the_folders",  # the GRPO one
    "runs/test_sampled_eval.py::test_sharded_placement_matches_one_device",  # parallel/ sharded checks
    "notebooks/test_notebooks.py::test_notebook_executes[03_rlhf_ppo_four_models]",  # PPO: algorithms/test_ppo.py
    "notebooks/test_notebooks.py::test_notebook_executes[04_many_runs_vmap]",
    "rollout/test_continuous.py::test_greedy_on_a_sliding_window_stack_with_min_new_tokens_equals_the_static_sampler",
    "rollout/test_sampler.py::test_row_blocks_on_cpu_threads_sample_what_one_program_samples[4-kw1]",  # [2-kw0]
    "rollout/test_sampler.py::test_min_new_tokens_never_draws_eos_before_it[3.0]",  # [0.0]
    "rollout/test_sampler.py::test_top_k_top_p_never_emit_excluded_tokens[3-1.0]",  # the other cases
    "models/test_attention.py::test_model_with_chunked_attention_equals_dense[3]",  # [1]
    "models/test_families.py::test_ppo_with_a_gemma_reward_model",  # Gemma's GRPO/DPO steps
    "models/test_families.py::test_dpo_step[gemma2-False]",  # [gemma3-True]
    "models/test_families.py::test_grpo_update[gemma2-False]",  # [gemma3-True]
    "models/test_lora_dropout.py::test_dropout_only_with_a_key_and_unbiased[scanned]",  # [unrolled]
    "models/test_lora.py::test_step_zero_adapters_off_and_merged[scanned]",  # [unrolled]
    "models/test_scan.py::test_remat_policies_give_the_gradients_of_none[offload]",  # [dots]
    "models/test_quant.py::test_logits_within_tolerance_of_the_float_model[int8]",  # [nf4]
    "algorithms/test_kl_placement.py::test_grpo_kl_in_the_reward_enters_the_group_advantage[k1]",  # [k3]
    "algorithms/test_grpo.py::test_loss_gradient_matches_hand_composed_ops[4]",  # [1]
    "algorithms/test_grpo.py::test_bf16_compute_path_runs",  # models/test_precision.py
    "algorithms/test_dpo.py::test_bf16_compute_path_is_finite",  # models/test_precision.py
    "algorithms/test_sft.py::test_bf16_compute_path_is_finite",  # models/test_precision.py
    "algorithms/test_reward_model.py::test_bf16_compute_path_is_finite",  # models/test_precision.py
    "algorithms/test_sft.py::test_accumulation_4x4_equals_1x16[seq-mean-token-mean]",  # [token-mean]
    "algorithms/test_ppo_lora.py::test_lora_reward_model_export_is_merged_and_loads_in_transformers",  # models/test_lora
    # added 2026-12-03 (the suite took 19.5 minutes on that day's slower VM)
    "runs/test_reward_ensemble.py::test_ensemble_and_own_trunk_run_end_to_end_and_resume",  # the members and
    # the trunk: this file in-process; resuming every phase: runs/test_workdir.py
    "algorithms/test_dpo.py::test_dpo_with_lora_raises_held_out_preference_accuracy",  # DPO learning: this file;
    # LoRA steps: models/test_lora.py
    "models/test_families.py::test_dpo_step[gemma3-True]",  # Gemma 3's training path: test_grpo_update[gemma3-True]
)


def pytest_addoption(parser):
    parser.addoption("--heavy", action="store_true", help="also run the tests in conftest.HEAVY")


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--heavy"):
        heavy = lambda item: any(item.nodeid.removeprefix("tests/").startswith(h) for h in HEAVY)
        deselected = [item for item in items if heavy(item)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not heavy(item)]
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
