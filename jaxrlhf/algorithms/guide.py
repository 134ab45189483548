"""Guidance on failed prompts: supervised learning on the reference completions of the
prompts that RL gets no signal from, inside the GRPO step.

A group whose G samples all score the same has zero advantage: a prompt the policy never
answers right teaches it nothing. ReLIFT (Ma et al. 2025, "Learning What Reinforcement
Learning Can't", arXiv:2506.07527) interleaves fine-tuning on the hardest questions into
RL; LUFFY (Yan et al. 2025, arXiv:2504.14945) puts a reference solution into the group;
SRFT (Fu et al. 2025, arXiv:2506.19767) adds an SFT term to the RL loss in one step. Here
the GRPO loss gets `c·NLL` of the task's reference completion for each prompt whose
group's best score is below a threshold (`GRPOConfig.guide_coef`, `guide_below`):

    failed_k  = max_{i ∈ group k} s_i < guide_below
    L_guide   = c · Σ_{k failed} Σ_t −log π(y*_{k,t} | x_k, y*_{k,<t}) / Σ_{k failed} |y*_k|

the token mean over the reference tokens of the failed prompts of the (mini)batch
(`guide_loss`). The prompts' references travel as reward extras (`GUIDE_KEYS`,
right-padded, the stop token included); each is attached to the first row of its group
(`guide_rows`), so the term follows its rows through shuffled minibatches and
micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms import common
from jaxrlhf.models.transformer import Transformer

GUIDE_KEYS = ("reference_ids", "reference_mask")


def failed_groups(scores_N: jax.Array, group_size: int, *, below: float) -> jax.Array:
    """`[N / G]` bool: the groups (contiguous, G rows each) whose best score is below `below`."""
    if scores_N.ndim != 1 or scores_N.shape[0] % group_size:
        raise ValueError(f"failed_groups: scores must be [N] with N a multiple of G = {group_size}, "
                         f"got {scores_N.shape}")
    return jnp.max(scores_N.reshape(-1, group_size), axis=1) < below


def guide_rows(reference_ids_NxR: jax.Array, reference_mask_NxR: jax.Array, failed_K: jax.Array,
               group_size: int) -> tuple[jax.Array, jax.Array]:
    """`(guide_ids [N, R], guide_mask [N, R] float32)`: each row's prompt's reference
    completion (`reference_*` repeated per sample), its mask kept only on the first row of
    each failed group (one reference per prompt, whatever G)."""
    n = reference_ids_NxR.shape[0]
    if failed_K.shape != (n // group_size,) or n % group_size:
        raise ValueError(f"guide_rows: {n} rows and failed_K {failed_K.shape} do not make groups of "
                         f"G = {group_size}")
    first_N = jnp.arange(n) % group_size == 0
    keep_N = first_N & jnp.repeat(failed_K, group_size)
    return reference_ids_NxR, (reference_mask_NxR.astype(bool) & keep_N[:, None]).astype(jnp.float32)


def guide_loss(model: Transformer, params, prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
               guide_ids_NxR: jax.Array, guide_mask_NxR: jax.Array, *, total_tokens: jax.Array | None = None,
               group_size: int = 1, dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The token-mean NLL of the guide tokens (without the coefficient):

        Σ_{i,t} m_{i,t} · (−log π(y*_{i,t} | x_i, y*_{i,<t})) / max(total_tokens, 1)

    on prompt ⧺ guide completion (prompts left-padded, completions right-padded; the log-probs
    at temperature 1, as in SFT). `total_tokens`: the minibatch's `Σ m` when these rows are
    one micro-batch of it (the sum over micro-batches is then the minibatch's token mean);
    None: this batch's own. `group_size` G > 1: rows come in whole groups of G with only
    each group's first row masked in (`guide_rows`), so only those rows are run.

    Returns: `(loss, nll)`, `nll` the stop-gradient token mean of these rows alone (0 when
    no token is masked in).
    """
    if guide_ids_NxR.shape != guide_mask_NxR.shape or prompt_ids_NxP.shape[0] != guide_ids_NxR.shape[0]:
        raise ValueError(f"guide_loss: guide ids {guide_ids_NxR.shape}, mask {guide_mask_NxR.shape} and prompts "
                         f"{prompt_ids_NxP.shape} must have the same rows (and ids and mask one shape)")
    if group_size > 1:
        prompt_ids_NxP, prompt_mask_NxP = prompt_ids_NxP[::group_size], prompt_mask_NxP[::group_size]
        guide_ids_NxR, guide_mask_NxR = guide_ids_NxR[::group_size], guide_mask_NxR[::group_size]
    mask = guide_mask_NxR.astype(jnp.float32)
    seq = jnp.concatenate([prompt_ids_NxP, guide_ids_NxR.astype(prompt_ids_NxP.dtype)], axis=1)
    attn = jnp.concatenate([prompt_mask_NxP.astype(jnp.int32), (mask > 0).astype(jnp.int32)], axis=1)
    logp, _, _ = common.response_logprobs(model, params, seq, attn, prompt_ids_NxP.shape[1], dropout_rng=dropout_rng)
    nll_sum = -jnp.sum(jnp.where(mask > 0, logp, 0.0) * mask)
    own = jnp.sum(mask)
    denom = own if total_tokens is None else total_tokens
    return nll_sum / jnp.maximum(denom, 1.0), jax.lax.stop_gradient(nll_sum / jnp.maximum(own, 1.0))


__all__ = ["GUIDE_KEYS", "failed_groups", "guide_loss", "guide_rows"]
