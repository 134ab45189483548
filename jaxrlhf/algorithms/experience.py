"""Rollout into training data: how responses are sampled (`SamplingConfig`, `sample_responses`)
and scored by forward passes (`score_responses`).

Shared by the online algorithms (PPO, GRPO family, RLOO): the sampler draws responses,
then the rollout policy's own forward pass gives `old_logp` (recomputed, not trusted from
the sampler: docs/concepts.md#the-clipped-losses) and the frozen reference gives
`ref_logp`. Everything is a pure function that can run inside the same jit as the update.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxrlhf.algorithms.common import response_logprobs
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.options import check, option
from jaxrlhf.rollout.continuous import sample_continuous
from jaxrlhf.rollout.sampler import SampleOutput, sample


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn; `temperature` also divides the trainer's logits
    (docs/concepts.md#shapes-masks-and-the-one-shift)."""

    max_new_tokens: int = option(8, "response tokens drawn at most", min=1)
    temperature: float = option(1.0, "τ of the sampler; it also divides the logits of every log-prob", above=0)
    top_k: int = option(0, "draw from the k most likely tokens only (0: all)", min=0)
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this much probability",
                          above=0, max=1)
    eos_id: int | tuple[int, ...] | None = option(None, "the token(s) that end a response (`sampler.stop_ids`)",
                                                  cli=False)
    pad_id: int = option(0, "the padding token id", cli=False)
    num_samples: int = option(1, "G responses per prompt (the group of GRPO and RLOO)", min=1)
    min_new_tokens: int = option(0, "EOS cannot be drawn before this many response tokens", min=0)
    slots: int = option(0, "0: one static batch of N rows; S > 0: continuous batching, S rows decoded at once "
                        "(`rollout.continuous`: the same tokens, faster where lengths spread)", min=0)

    def __post_init__(self):
        check(self)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"SamplingConfig.min_new_tokens={self.min_new_tokens} is impossible: it must be <= "
                             f"max_new_tokens={self.max_new_tokens}")


def sample_responses(model: Transformer, params, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
                     sampling: SamplingConfig) -> SampleOutput:
    """`sampling.num_samples` responses to each of the `B` prompts `[B, P]` (left-padded),
    `N = B·G` rows with each prompt's samples contiguous, drawn as `sampling` says: one
    static batch, or with `sampling.slots = S > 0` continuous batching over S slots
    (`rollout.continuous`; the same tokens, faster where response lengths spread)."""
    kw = dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
              top_p=sampling.top_p, eos_id=sampling.eos_id, pad_id=sampling.pad_id,
              num_samples=sampling.num_samples, min_new_tokens=sampling.min_new_tokens)
    if sampling.slots:
        return sample_continuous(model, params, prompt_ids, prompt_mask, rng, slots=sampling.slots, **kw)
    return sample(model, params, prompt_ids, prompt_mask, rng, **kw)


def score_responses(model: Transformer, params, sequences, attention_mask, prompt_len: int, *, temperature: float,
                    group_size: int = 1):
    """`logp [N, T]` of the response tokens under `params` (no gradient needed); with
    `group_size = G`, rows are groups of G sharing a prompt, which then runs once."""
    logp, _, _ = response_logprobs(model, jax.lax.stop_gradient(params), sequences, attention_mask, prompt_len,
                                   temperature=temperature, group_size=group_size)
    return logp
