"""benchmarks/bench_grpo.py's logic that is not a timing: the algorithm settings of both
sides (GRPO, CISPO, GDPO, OPD), the rewards both compute, GKD's dataset and batch, TRL's
optimizer steps grouped into iterations, and how rows are paired for their ratios. The
timed runs themselves are docs/benchmarks.md's."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grpo.py"


@pytest.fixture
def bench(monkeypatch):
    # The benchmarks' _common tunes glibc's allocator on import unless told not to: leave
    # the test process as it is, and its sys.path too (the script puts benchmarks/ first).
    monkeypatch.setenv("JAXRLHF_HOST_ALLOCATOR", "default")
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jax_cfg(bench, algo):
    from jaxrlhf.algorithms import grpo
    from jaxrlhf.algorithms.experience import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=bench.T_NEW, temperature=1.0, top_k=0, top_p=1.0, eos_id=None,
                              pad_id=0, num_samples=bench.G)
    return grpo.GRPOConfig(sampling=sampling, **algo["jax"])


def test_the_default_is_the_reference_workloads_grpo(bench):
    algo = bench.algorithm()
    assert algo["name"] == "grpo" and algo["rewards"] == ("frac7",)
    assert algo["jax"] == dict(advantage="grpo", adv_eps=1e-4, beta=0.0, clip_low=0.2, agg="token-mean",
                               num_iterations=1, num_minibatches=1)
    assert algo["trl"] == dict(per_device_train_batch_size=16, steps_per_generation=1, beta=0.0, loss_type="dapo",
                               scale_rewards="group", epsilon=0.2, num_iterations=1)
    assert _jax_cfg(bench, algo).updates_per_iteration == 1


def test_cispo_clips_the_ratio_at_the_same_bound_on_both_sides(bench):
    algo = bench.algorithm(policy_loss="cispo", minibatches=2)
    cfg = _jax_cfg(bench, algo)
    assert (cfg.policy_loss, cfg.clip_low, cfg.clip_high, cfg.num_minibatches) == ("cispo", 1.0, 4.0, 2)
    assert cfg.updates_per_iteration == 2 and not cfg.reuses_rollout_logp  # the ratio leaves 1
    # jaxrlhf clips rho to [1 - clip_low, 1 + clip_high]; TRL's cispo clamps rho at epsilon_high itself.
    assert algo["trl"]["loss_type"] == "cispo" and algo["trl"]["epsilon_high"] == 1.0 + cfg.clip_high
    assert algo["trl"]["steps_per_generation"] * algo["trl"]["per_device_train_batch_size"] == 16
    assert algo["name"] == "cispo (rho <= 5), 2 minibatches"
    with pytest.warns(UserWarning, match="plain REINFORCE"):  # one minibatch: ratio 1 (on both sides)
        _jax_cfg(bench, bench.algorithm(policy_loss="cispo"))


def test_gdpo_has_two_rewards_normalised_apart_on_both_sides(bench):
    from jaxrlhf.algorithms import advantages

    algo = bench.algorithm(advantage="gdpo")
    assert algo["rewards"] == ("frac7", "even_count") and _jax_cfg(bench, algo).advantage == "gdpo"
    assert algo["trl"]["multi_objective_aggregation"] == "normalize_then_sum"
    assert algo["trl"]["reward_weights"] == [1.0, 1.0]
    reward = bench.jax_reward(algo["rewards"])
    assert reward.names == ("frac7", "even_count") and [c.weight for c in reward.components] == [1.0, 1.0]
    advantages.check_reward("gdpo", reward)  # two weighted components: accepted


def test_trl_builds_the_same_settings(bench, tmp_path):
    import trl  # a test requirement (pyproject.toml): a missing TRL is a failure, not a skip
    for algo in (bench.algorithm(), bench.algorithm(policy_loss="cispo", minibatches=2),
                 bench.algorithm(advantage="gdpo")):
        args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=bench.G,
                              max_completion_length=bench.T_NEW, **algo["trl"])
        assert args.generation_batch_size == 16  # 2 prompts x 8 samples per generation
        assert args.loss_type == algo["trl"]["loss_type"]
    assert args.multi_objective_aggregation == "normalize_then_sum"


def test_opd_settings_and_the_combinations_refused(bench):
    algo = bench.algorithm(opd=True)
    assert algo["name"] == "opd" and algo["jax"] == bench.algorithm()["jax"]  # GRPO's loss, clip 0.2, mu = 1
    assert {k: algo["trl"][k] for k in ("lmbda", "beta", "temperature", "max_new_tokens")} == \
        dict(lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=64)
    with pytest.raises(ValueError, match="opd"):
        bench.algorithm(policy_loss="cispo", opd=True)
    with pytest.raises(ValueError, match="minibatches"):
        bench.algorithm(minibatches=3)
    for argv in (["--opd", "--lora", "16"], ["--opd", "--advantage", "gdpo"], ["--teacher-layers", "8"],
                 ["--advantage", "gdpo", "--tunix-python", "python"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):  # refused before anything runs
            bench.main(argv)


def test_both_sides_compute_the_same_rewards(bench):
    from jaxrlhf import rewards

    ids = np.random.default_rng(0).integers(0, 512, (16, 64))
    ids[0, :5] = bench.TARGET
    reward = bench.jax_reward(("frac7", "even_count"))
    scores = reward.device_scores(rewards.RewardInput(None, None, ids, np.ones_like(ids, bool), None, None), {})
    for name, fn in bench.TRL_REWARDS.items():
        assert fn.__name__ == name  # TRL logs each reward by its function's name
        theirs = fn(prompts=None, completions=None, completion_ids=ids.tolist())
        np.testing.assert_allclose(np.asarray(scores[name]), theirs, rtol=1e-6)
    assert scores["frac7"][0] >= 5 / 64 and 20 < float(np.mean(scores["even_count"])) < 44


def test_gkd_reads_the_steps_prompts_in_order_and_counts_the_generated_tokens(bench):
    torch = pytest.importorskip("torch")
    order = np.random.default_rng(0).permutation(64)
    rows = bench.gkd_rows(order, 3)
    assert rows.shape == (3 * 16,)
    for i in range(3):  # step i: jaxrlhf's 2 prompts, each repeated for its 8 samples
        np.testing.assert_array_equal(rows[16 * i:16 * (i + 1)], np.repeat(bench.step_rows(order, i), 8))
    prompts = np.random.default_rng(1).integers(4, 512, (64, 32))
    batch = bench.gkd_collator(32)([{"prompt_ids": prompts[r].tolist()} for r in rows[:16]])
    np.testing.assert_array_equal(batch["prompts"].numpy(), prompts[rows[:16]])
    assert batch["input_ids"].shape == (16, 96) and bool(torch.all(batch["prompt_attention_mask"] == 1))
    # The Trainer's token count (labels[..., 1:] != -100) is the 16 x 64 tokens GKD generates.
    assert int((batch["labels"][..., 1:] != -100).sum()) == 16 * 64
    assert bool(torch.all(batch["labels"][:, :32] == -100))


def test_trl_optimizer_steps_are_summed_per_generation(bench):
    steps = [(1.0, 0.5), (2.0, 0.0), (3.0, 1.0), (4.0, 0.0)]
    assert bench.group_steps(steps, 2) == [(3.0, 0.5), (7.0, 1.0)]
    assert bench.group_steps(steps, 1) == steps
    with pytest.raises(ValueError):
        bench.group_steps(steps[:3], 2)


def _row(times):
    return {"stats": {"median_s": float(np.median(times))}, "step_times": times}


def test_ratios_pair_each_round_and_pool_the_rounds(bench):
    results = {"jaxrlhf": _row([1.0, 1.0]), "jaxrlhf lora 16": _row([2.0, 2.0]), "trl (grad ckpt on)": _row([3.0, 3.0]),
               "trl lora 16 (grad ckpt on)": _row([8.0, 8.0]), "jaxrlhf [round 2]": _row([2.0, 2.0]),
               "trl (grad ckpt on) [round 2]": _row([4.0, 4.0])}
    got = {(q["peer"], q["ours"]): q["ratio"] for q in bench.ratios(results)}
    assert got == {("trl (grad ckpt on)", "jaxrlhf"): 3.0, ("trl lora 16 (grad ckpt on)", "jaxrlhf lora 16"): 4.0,
                   ("trl (grad ckpt on) [round 2]", "jaxrlhf [round 2]"): 2.0,
                   ("trl (grad ckpt on) [2 rounds pooled]", "jaxrlhf [2 rounds pooled]"): 3.5 / 1.5}
