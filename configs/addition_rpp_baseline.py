"""The built-in addition task with REINFORCE++-baseline advantages in place of GRPO's.

    python -m jaxrlhf.train --config=configs/addition_rpp_baseline.py --workdir=/tmp/addition_rpp_baseline

addition_grpo.py's recipe (the same SFT warm start, 1,500 steps of 64 groups of 8 kept by
dynamic sampling from a pool of 192 prompts, SRFT-style guidance, exact match + 0.5 x
partial credit, lr 3e-4 cosine, the clipped surrogate) with one change: the advantage
(`grpo.advantage=reinforce_pp_baseline`, docs/concepts.md#reinforce-with-a-group-baseline):
each score less its group's mean, then whitened over the valid tokens of the whole batch,
in place of GRPO's per-group z-score (no division by a group's own standard deviation).

Measured 2026-12-06 on an AMD EPYC family-25 VM, 2 cores shared with two other jobs (the
run niced; `benchmarks/learning_43.py --seeds 0 --configs ...,addition_rpp_baseline`;
held-out greedy exact match on the 500 test sums, the last evaluation): seed 0 only,
0.794 -> 0.954 (+16.0 points), 316 s. For comparison, addition_grpo.py's seed 0 from the
same SFT point: 0.794 -> 0.966 (measured 2026-12-04 on another VM). Seeds 1 and 2: not yet
measured.

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
                       sampling=dict(max_new_tokens=4, num_samples=8), advantage="reinforce_pp_baseline",
                       agg="token-mean", guide_coef=1.0, guide_below=2.0,
                       optim=dict(lr=3e-4, schedule="cosine", warmup_steps=10))
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
