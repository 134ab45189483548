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
    c = base.recipe(__file__, "addition_grpo", arg)  # the default recipe, its variants included
    # CISPO's loss; two minibatches so that the second update's ratio moves off 1 and clips.
    c.grpo.update(policy_loss="cispo", clip_low=1.0, clip_high=4.0, num_minibatches=2)
    c.lock()
    return c
