"""The rollout engine: jitted sampling with a KV cache.

`generate` compiles once per shape (on a CPU device it runs the prompts as concurrent row
blocks, one per core); `sample` is the same function for use inside your own jitted step.
Row r of a batch draws step t's Gumbel noise from `fold_in(fold_in(rng, r), t)`: its tokens
never depend on the other rows, so a batch split over a mesh or into `generate`'s CPU row
blocks samples exactly what it samples whole.
"""

from jaxrlhf.rollout.sampler import SampleOutput, generate, sample, truncate_logits

__all__ = ["SampleOutput", "generate", "sample", "truncate_logits"]
