"""The built-in addition task with CISPO in place of GRPO's clipped surrogate.

    python -m jaxrlhf.train --config=configs/addition_cispo.py --workdir=/tmp/addition_cispo

addition_grpo.py's recipe (the same SFT warm start, 1,500 steps of 64 groups of 8 kept by
dynamic sampling from a pool of 192 prompts, SRFT-style guidance, exact match + 0.5 x
partial credit, lr 3e-4 cosine) with the policy loss CISPO's (`grpo.policy_loss=cispo`,
MiniMax-M1, docs/concepts.md#cispo): REINFORCE weighted by the stop-gradient importance ratio
clipped to [1 − ε_low, 1 + ε_high], so that no token's gradient is dropped as the clipped
surrogate drops it. ε_low = `clip_low` = 1 (no lower bound), ε_high = `clip_high` = 4.

The one change the algorithm needs besides: two minibatches per rollout batch
(`grpo.num_minibatches=2`, so 3,000 optimizer steps over the run, which the learning-rate
schedule counts). With a single update per batch the policy being updated is the rollout
policy, the ratio is exactly 1, and CISPO is plain REINFORCE with GRPO's advantages
(GRPOConfig warns). With two minibatches the health monitor's `[sampler_logp]` line can
fire: GRPO's `logp_mismatch` is the max over the update's steps, so it includes the second
minibatch's drift from the first's update (docs/grpo.md#metrics), not only the sampler's.

Measured 2026-12-06 on an AMD EPYC family-25 VM, 2 cores shared with two other jobs (the
run niced; `benchmarks/learning_43.py --seeds 0 --configs addition_cispo,...`; held-out greedy
exact match on the 500 test sums, the last evaluation): seed 0 only, 0.794 -> 0.990
(+19.6 points), 1,323 s (contended: an upper bound); `clipfrac` up to 0.0012. For
comparison, addition_grpo.py's seed 0 from the same SFT point: 0.794 -> 0.966 (measured
2026-12-04 on another VM). Seeds 1 and 2: not yet measured.

Variants: `:tiny` (a few steps of each phase, for tests).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    base.parallel(c)
    c.task = base.task(num_digits=2, num_train=8000, num_test=500, partial_credit=0.5)
    c.reward = base.reward()  # Python rewards beside the task's: --config.reward.fns=pkg.mod:fn
    c.model = base.model()  # 0.43M parameters: 2 layers, width 128
    c.sft = base.addition_warm_start()
    c.grpo = base.grpo(steps=1500, prompts_per_step=64, pool_size=192, dynamic_sampling=True,
                       sampling=dict(max_new_tokens=4, num_samples=8), advantage="grpo", agg="token-mean",
                       policy_loss="cispo", clip_low=1.0, clip_high=4.0, num_minibatches=2,
                       guide_coef=1.0, guide_below=2.0, optim=dict(lr=3e-4, schedule="cosine", warmup_steps=10))
    c.train = base.train(log_every=10, eval_every=100, checkpoint_every=250)
    if arg == "tiny":
        c.task.num_train, c.task.num_test = 256, 64
        c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
        c.sft.steps, c.sft.batch_size = 4, 16
        c.grpo.update(steps=3, prompts_per_step=4, pool_size=8)
        c.grpo.sampling.num_samples = 4
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
