"""Attention behind one function: `attend`, with implementations chosen by backend, length
and config.

Every implementation computes, for query `l` of row `b` and head `n` (kv head `k = n // G`,
`G = N / K` query heads per kv head, no keys or values repeated):

    o[b, l, n] = Σ_s softmax_s( scale · q[b, l, n] · k[b, s, k]  where allowed(b, l, s) ) v[b, s, k]

    allowed(b, l, s) = key_valid[b, s]  ∧  s ≤ query_slot[l]  ∧  s > query_slot[l] − window

`key_valid` `[B, S]` marks real tokens (left-padded prompts, right-padded responses, cache
slots not written yet are all False); `query_slot` `[L]` is each query's slot in the `S`
keys (`arange(L)` for a full forward, `cache_index + arange(L)` with a KV cache), so the
causal and local-window rules are on slot indices, as transformers applies them. A query
with no allowed key (a padding row) gets the mean of all `S` values, finite (masked scores
are `finfo(float32).min`, not −inf), exactly as the dense reference does.

The mask is two linear-size arrays (`AttentionMask`), never `[B, L, S]`: at L = 16k one
boolean `[L, S]` mask alone is 256 MiB per row.

Implementations (`ModelConfig.attention`, names in `IMPLEMENTATIONS`):
- "dense": scores `[B, K, G·L, S]` in float32, the reference; quadratic memory.
- "chunked": online softmax over key blocks for blocks of queries, with a hand-written
  backward pass (`custom_vjp`) that recomputes each block's probabilities: O(L·block)
  memory in the forward and the backward pass, any backend. Key blocks wholly outside the
  causal/window band of a query block are skipped.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` on NVIDIA GPUs (flash
  attention in cuDNN).
- "auto" (default): dense where its score array is small (short sequences, decode steps),
  cuDNN on a GPU where it applies, chunked otherwise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "dense", "chunked", "cudnn")

# "auto" keeps the dense form while its float32 score array [B, K, G·L, S] has at most this
# many elements per (batch row, kv head): 2**20 = a 1k × 1k causal block, 4 MiB.
_DENSE_MAX_SCORES = 2**20
_NEG = float(jnp.finfo(jnp.float32).min)


class AttentionMask(NamedTuple):
    """Which keys each query may attend to, in linear size (see the module docstring).

    key_valid: `[B, S]` bool, True on real tokens.
    query_slot: `[L]` int32, each query's slot among the `S` keys (queries are consecutive).
    """

    key_valid: jax.Array
    query_slot: jax.Array


def allowed_BxLxS(mask: AttentionMask, window: int | None) -> jax.Array:
    """The `[B, L, S]` boolean mask that `mask` stands for (dense form and tests only)."""
    s = mask.key_valid.shape[1]
    key_slot, q_slot = jnp.arange(s)[None, :], mask.query_slot[:, None]
    ok_LxS = key_slot <= q_slot
    if window is not None:
        ok_LxS &= key_slot > q_slot - window
    return mask.key_valid[:, None, :] & ok_LxS[None]


def dense(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask: AttentionMask, *, scale: float, window: int | None = None,
          keys_transposed: bool = False):
    """The reference: all scores `[B, K, G·L, S]` at once, softmax in float32.

    `keys_transposed`: keys come as `[B, K, H, S]` (the KV cache's layout).
    Returns `[B, L, N, H]` in the dtype of `q`.
    """
    b, l, n, h = q_BxLxNxH.shape
    kh = k_BxKxSxH.shape[1]
    g = n // kh
    dt = q_BxLxNxH.dtype
    s = v_BxKxSxH.shape[2]
    # Query heads of one kv group are folded into the row axis: one batched matmul per
    # (batch, kv head), no repeated keys.
    q_BxKxQxH = q_BxLxNxH.reshape(b, l, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * l, h)
    if keys_transposed:
        scores = jnp.einsum("BKQH,BKHS->BKQS", q_BxKxQxH, k_BxKxSxH.astype(dt))
    else:
        scores = jnp.einsum("BKQH,BKSH->BKQS", q_BxKxQxH, k_BxKxSxH.astype(dt))
    scores = scores.astype(jnp.float32) * scale
    allowed = allowed_BxLxS(mask, window)
    mask_BxQxS = jnp.broadcast_to(allowed[:, None], (b, g, l, s)).reshape(b, 1, g * l, s)
    # finfo.min rather than -inf: a fully masked row (a padding query) stays finite.
    scores = jnp.where(mask_BxQxS, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, v_BxKxSxH.astype(dt))
    return out.reshape(b, kh, g, l, h).transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)


def choose(implementation: str, *, num_queries: int, num_keys: int, num_groups: int) -> str:
    """The implementation "auto" resolves to (any other name is returned as it is)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention={implementation!r}; expected one of {list(IMPLEMENTATIONS)}")
    if implementation != "auto":
        return implementation
    if num_groups * num_queries * num_keys <= _DENSE_MAX_SCORES:
        return "dense"
    return "chunked"


def attend(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask: AttentionMask, *, implementation: str = "auto",
           scale: float, window: int | None = None, keys_transposed: bool = False):
    """Attention of `q` over `S` keys under `mask` (see the module docstring for the formula).

    Args:
      q_BxLxNxH: queries (after RoPE), `N = G·K` heads.
      k_BxKxSxH: keys `[B, K, S, H]`, or `[B, K, H, S]` with `keys_transposed`.
      v_BxKxSxH: values `[B, K, S, H]`.
      mask: `AttentionMask(key_valid [B, S], query_slot [L])`.
      implementation: a name in `IMPLEMENTATIONS`.
      scale: the score scale (`head_dim ** -0.5`).
      window: a local window (keys within the last `window` slots of the query's), or None.

    Returns: `[B, L, N, H]` in the dtype of `q`.
    """
    _, l, n, _ = q_BxLxNxH.shape
    kh, s = v_BxKxSxH.shape[1], v_BxKxSxH.shape[2]
    impl = choose(implementation, num_queries=l, num_keys=s, num_groups=n // kh)
    if impl == "dense":
        return dense(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask, scale=scale, window=window,
                     keys_transposed=keys_transposed)
    raise NotImplementedError(f"attention={impl!r}")
