"""RL primitives for language models: pure, jit-able functions on response-aligned arrays.

Shapes: `B` sequences, `T` response length (right-padded), `V` vocabulary, `N = prompts·G`
grouped sequences. `mask` `[B, T]` (bool or float) is 1 on real response tokens, a
contiguous prefix; padding never changes a result. In an episode it is 1 on the policy's
tokens only, with holes where the environment's tokens are: a function of such a mask gives
what it gives with those tokens deleted (docs/concepts.md#gae-over-a-mask-with-holes).
Every function computes in float32 whatever its input dtype (`linear_logprobs` runs its
matmul in the inputs' dtype). The formulas are those of docs/concepts.md; the public names,
keyword names, argument order and defaults are a stable contract
(docs/concepts.md#the-primitives-api), and arguments added beyond them (gae's `method`,
entropy's `chunk_size`) are keyword-only. `linear_logprobs` is the log-prob and entropy of
`token_logprobs` / `entropy` with the LM head fused in, for vocabularies too large for
`[B, T, V]`.

    logp = ops.token_logprobs(ops.shift_logits_for_response(logits, P), response)
    logp = ops.linear_logprobs(hidden, w_head, response).logp   # same, no [B, T, V] logits
    rewards = ops.shape_rewards(scores, ops.kl(logp, ref_logp, estimator="k1"), mask, beta)
    adv, ret = ops.gae(rewards, values, mask)
    loss, metrics = ops.policy_loss(logp, old_logp, ops.whiten(adv, mask), mask)
"""

from jaxrlhf.ops._advantages import (
    GROUP_METHODS,
    GAEOutput,
    broadcast_sequence,
    distillation_advantages,
    gae,
    gdpo_advantages,
    group_advantages,
    whiten,
)
from jaxrlhf.ops._importance import IS_LEVELS, IS_MODES, importance_weights
from jaxrlhf.ops._kl import KL_ESTIMATORS, approx_kl, kl, shape_rewards
from jaxrlhf.ops._linear_logprobs import LinearLogprobs, linear_logprobs
from jaxrlhf.ops._logprobs import (
    entropy,
    sequence_logprobs,
    shift_logits_for_response,
    token_logprobs,
)
from jaxrlhf.ops._losses import cispo_loss, dpo_loss, policy_loss, reward_model_loss, value_loss
from jaxrlhf.ops._masked import AGGREGATE_MODES, aggregate, masked_mean, masked_sum, masked_var

__all__ = [
    # log-probabilities
    "token_logprobs",
    "entropy",
    "sequence_logprobs",
    "shift_logits_for_response",
    "LinearLogprobs",
    "linear_logprobs",
    # KL to the reference
    "KL_ESTIMATORS",
    "kl",
    "approx_kl",
    "shape_rewards",
    # advantages
    "GAEOutput",
    "gae",
    "whiten",
    "group_advantages",
    "GROUP_METHODS",
    "broadcast_sequence",
    "gdpo_advantages",
    "distillation_advantages",
    # off-policy correction
    "IS_MODES",
    "IS_LEVELS",
    "importance_weights",
    # losses and aggregation
    "AGGREGATE_MODES",
    "aggregate",
    "policy_loss",
    "cispo_loss",
    "value_loss",
    "dpo_loss",
    "reward_model_loss",
    # masked reductions
    "masked_sum",
    "masked_mean",
    "masked_var",
]
