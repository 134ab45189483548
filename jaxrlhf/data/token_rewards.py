"""Rule-based rewards on token ids for tasks with a known answer, usable inside `jit`.

A response is correct when its tokens, up to and including its first EOS, are exactly the
answer's tokens followed by EOS; whatever follows that EOS is ignored. The jnp functions
run on device inside a rollout step; `exact_match` and `token_match_fraction` are
independent host-side (numpy, loop) versions with the same definition, used as the
reference in tests and for evaluation on host.

Layout (docs/concepts.md#shapes-masks-and-the-one-shift): responses right-padded,
`response_mask` 1 on real tokens (EOS included), a contiguous prefix; answers likewise
right-padded with `answer_mask`, WITHOUT EOS. Masks may be bool or numeric.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrlhf.data.char_tokenizer import EOS_ID


def _aligned_hits(response_ids_BxT, response_mask_BxT, answer_ids_BxA, answer_mask_BxA, eos_id):
    """(hit_BxL, need_BxL, len_B) with L = A + 1: position-wise agreement with answer ⧺ EOS."""
    response_ids_BxT = jnp.asarray(response_ids_BxT)
    answer_ids_BxA = jnp.asarray(answer_ids_BxA)
    if response_ids_BxT.ndim != 2 or answer_ids_BxA.ndim != 2:
        raise ValueError(
            f"expected [B, T] responses and [B, A] answers, got {response_ids_BxT.shape} and "
            f"{answer_ids_BxA.shape}")
    if response_ids_BxT.shape[0] != answer_ids_BxA.shape[0]:
        raise ValueError(f"batch sizes differ: {response_ids_BxT.shape} vs {answer_ids_BxA.shape}")
    if jnp.shape(response_mask_BxT) != response_ids_BxT.shape:
        raise ValueError(f"response_mask {jnp.shape(response_mask_BxT)} != ids {response_ids_BxT.shape}")
    if jnp.shape(answer_mask_BxA) != answer_ids_BxA.shape:
        raise ValueError(f"answer_mask {jnp.shape(answer_mask_BxA)} != ids {answer_ids_BxA.shape}")
    B, T = response_ids_BxT.shape
    L = answer_ids_BxA.shape[1] + 1
    len_B = jnp.sum(jnp.asarray(answer_mask_BxA).astype(jnp.int32), axis=-1)
    pos_L = jnp.arange(L)
    answer_BxL = jnp.pad(answer_ids_BxA, ((0, 0), (0, 1)))
    target_BxL = jnp.where(pos_L[None, :] < len_B[:, None], answer_BxL, eos_id)
    need_BxL = pos_L[None, :] <= len_B[:, None]
    # Compare on exactly L positions: a response shorter than answer ⧺ EOS is padded with
    # masked-out slots (which never hit); a longer one is cut, its tail is after the EOS.
    resp_mask_BxT = jnp.asarray(response_mask_BxT).astype(bool)
    if T < L:
        response_ids_BxT = jnp.pad(response_ids_BxT, ((0, 0), (0, L - T)))
        resp_mask_BxT = jnp.pad(resp_mask_BxT, ((0, 0), (0, L - T)))
    hit_BxL = (response_ids_BxT[:, :L] == target_BxL) & resp_mask_BxT[:, :L] & need_BxL
    return hit_BxL, need_BxL, len_B


def exact_match_reward(
    response_ids_BxT, response_mask_BxT, answer_ids_BxA, answer_mask_BxA, *, eos_id: int = EOS_ID
) -> jnp.ndarray:
    """[B] float32: 1.0 if the response up to its first EOS is `answer ⧺ EOS`, else 0.0.

    A response that never emits EOS within its mask (truncated) scores 0.
    """
    hit_BxL, need_BxL, _ = _aligned_hits(
        response_ids_BxT, response_mask_BxT, answer_ids_BxA, answer_mask_BxA, eos_id)
    return jnp.all(hit_BxL | ~need_BxL, axis=-1).astype(jnp.float32)


def token_match_reward(
    response_ids_BxT, response_mask_BxT, answer_ids_BxA, answer_mask_BxA, *, eos_id: int = EOS_ID
) -> jnp.ndarray:
    """[B] float32 partial credit: the fraction of the `len_a + 1` tokens of `answer ⧺ EOS`
    that the response reproduces at the same position.

    Equals 1.0 exactly when `exact_match_reward` does. A shaped signal for early RL on the
    arithmetic task: "95<eos>" for answer "96" scores 2/3 (the '9' and the EOS). Positional,
    so a dropped digit shifts everything after it and earns little.
    """
    hit_BxL, _, len_B = _aligned_hits(
        response_ids_BxT, response_mask_BxT, answer_ids_BxA, answer_mask_BxA, eos_id)
    return (jnp.sum(hit_BxL, axis=-1) / (len_B + 1)).astype(jnp.float32)


def _valid_lists(ids_BxT, mask_BxT):
    ids_BxT, mask_BxT = np.asarray(ids_BxT), np.asarray(mask_BxT).astype(bool)
    return [row[m].tolist() for row, m in zip(ids_BxT, mask_BxT)]


def exact_match(response_ids, response_mask, answer_ids, answer_mask, *, eos_id: int = EOS_ID) -> np.ndarray:
    """Host-side [B] bool, same definition as `exact_match_reward`."""
    out = []
    for resp, ans in zip(_valid_lists(response_ids, response_mask), _valid_lists(answer_ids, answer_mask)):
        out.append(eos_id in resp and resp[: resp.index(eos_id)] == ans)
    return np.asarray(out, dtype=bool)


def token_match_fraction(
    response_ids, response_mask, answer_ids, answer_mask, *, eos_id: int = EOS_ID
) -> np.ndarray:
    """Host-side [B] float32, same definition as `token_match_reward`."""
    out = []
    for resp, ans in zip(_valid_lists(response_ids, response_mask), _valid_lists(answer_ids, answer_mask)):
        target = ans + [eos_id]
        hits = sum(1 for t, tok in enumerate(target) if t < len(resp) and resp[t] == tok)
        out.append(hits / len(target))
    return np.asarray(out, dtype=np.float32)
