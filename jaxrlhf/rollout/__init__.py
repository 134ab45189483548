"""The rollout engine: jitted sampling with a KV cache."""

from jaxrlhf.rollout.sampler import SampleOutput, generate, sample, truncate_logits

__all__ = ["SampleOutput", "generate", "sample", "truncate_logits"]
