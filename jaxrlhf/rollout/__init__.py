"""The rollout engine: jitted sampling with a KV cache.

`generate` compiles once per shape (on a CPU device it runs the prompts as concurrent row
blocks, one per core); `sample` is the same function for use inside your own jitted step.
Row r of a batch draws step t's noise from `fold_in(fold_in(rng, r), t)`: its tokens
never depend on the other rows, so a batch split over a mesh or into `generate`'s CPU row
blocks samples exactly what it samples whole. `pad_to_bucket` left-pads prompts to a few
bucket lengths (a handful of programs for a dataset of varied lengths) and `CompileCounter`
counts XLA compilations (`rollout.buckets`). `generate_continuous` / `sample_continuous`
sample the same tokens by continuous batching: S slots fed from the queue of rows, a slot
taking the next row when its own ends (`rollout.continuous`).
"""

from jaxrlhf.rollout.buckets import DEFAULT_BUCKETS, CompileCounter, bucket_length, pad_to_bucket
from jaxrlhf.rollout.continuous import generate_continuous, sample_continuous
from jaxrlhf.rollout.sampler import SampleOutput, generate, sample, truncate_logits

__all__ = ["DEFAULT_BUCKETS", "CompileCounter", "SampleOutput", "bucket_length", "generate", "generate_continuous",
           "pad_to_bucket", "sample", "sample_continuous", "truncate_logits"]
