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
    c = base.recipe(__file__, "addition_grpo", arg)  # the default recipe, its variants included
    c.grpo.advantage = "reinforce_pp_baseline"
    c.lock()
    return c
