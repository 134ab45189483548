"""Token log-probabilities and entropies from logits (SPEC §2).

For a large vocabulary the `[B, T, V]` logits dominate memory, so neither function builds
a float32 log-softmax: a log-prob is the gathered logit minus a logsumexp, and both run
over chunks of tokens so that at most `chunk_size × V` float32 values exist at once.

Chunking is needed even though XLA fuses the float32 upcast into the logsumexp reduction
for float32 inputs: for bf16 logits (XLA:CPU, jax 0.10) the upcast is materialised as a
full `[B, T, V]` float32 copy, and the entropy keeps two `[B, T, V]` float32 temporaries
for any dtype — measured with `compile().memory_analysis()` at B=8, T=512, V=151,936
(see benchmarks/bench_ops.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrlhf.ops import _checks

# Float32 elements one chunk may hold: 2**26 × 4 bytes = 256 MiB, i.e. 441 tokens at
# V = 151,936, and no chunking at all for small vocabularies.
_CHUNK_ELEMENTS = 2**26


def _chunk_rows(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}")
    return chunk_size


def _map_rows(fn: Callable, rows: tuple[jax.Array, ...], chunk: int) -> jax.Array:
    """Applies `fn` (rows `[n, ...]` -> `[n]`) to `chunk` rows at a time.

    Full chunks run under `lax.map` with `jax.checkpoint`, so that the backward pass also
    recomputes one chunk at a time instead of saving every chunk's softmax; the remainder
    (`n % chunk` rows) is one static slice, so the logits are never padded (a copy).
    """
    n = rows[0].shape[0]
    n_full, rem = divmod(n, chunk)
    if n <= chunk:
        return fn(*rows)

    @jax.checkpoint
    def one_chunk(i):
        return fn(*(lax.dynamic_slice_in_dim(r, i * chunk, chunk, axis=0) for r in rows))

    out = lax.map(one_chunk, jnp.arange(n_full)).reshape(n_full * chunk)
    if rem:
        out = jnp.concatenate([out, fn(*(r[n_full * chunk :] for r in rows))])
    return out


def token_logprobs(
    logits: jax.Array,
    targets: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    chunk_size: int | None = None,
) -> jax.Array:
    """Log-probability of each target token under `softmax(logits / τ)`.

        logp[b, t] = logits[b, t, y]/τ − logsumexp_v(logits[b, t, v]/τ),   y = targets[b, t]

    `logits` must already be aligned with `targets` (see `shift_logits_for_response`), and
    the same temperature as the sampler's must be used everywhere (SPEC §2).

    Args:
      logits: `[B, T, V]` response-aligned logits, any float dtype (float32 math).
      targets: `[B, T]` integer token ids in `[0, V)`; ids outside give NaN (mask them).
      temperature: `τ > 0`, dividing the logits.
      chunk_size: tokens (rows of the flattened `[B·T, V]`) processed at once; `None`
        picks the largest chunk whose float32 copy stays within 256 MiB.

    Returns:
      `[B, T]` float32 log-probabilities.
    """
    fn = "token_logprobs"
    logits = jnp.asarray(logits)
    if logits.ndim != 3 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `logits` must be a float array of shape [B, T, V], got "
            f"{logits.dtype}{list(logits.shape)}"
        )
    b, t, v = logits.shape
    targets = _checks.like(fn, "targets", targets, ("B", "T"), "logits[..., 0]", (b, t))
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{fn}: `targets` must be an integer array, got dtype {targets.dtype}")
    _checks.positive(fn, "temperature", temperature)
    inv_tau = 1.0 / jnp.asarray(temperature, jnp.float32)

    def rows_logp(logits_NxV, targets_N):
        # The gathered logit is upcast after the gather: exact, and only N values.
        picked = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
        lse = jax.nn.logsumexp(logits_NxV.astype(jnp.float32) * inv_tau, axis=-1)
        return picked.astype(jnp.float32) * inv_tau - lse

    chunk = _chunk_rows(chunk_size, v)
    out = _map_rows(rows_logp, (logits.reshape(b * t, v), targets.reshape(b * t)), chunk)
    return out.reshape(b, t)


def entropy(
    logits: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    chunk_size: int | None = None,
) -> jax.Array:
    """Entropy of `p = softmax(logits / τ)` at every position.

        H[b, t] = −Σ_v p_v log p_v = logsumexp(x) − Σ_v p_v x_v,   x = logits[b, t] / τ

    computed as `log s − Σ_v e_v (x_v − m) / s` with `m = max x`, `e = exp(x − m)`,
    `s = Σ e`; entries with `p_v = 0` (e.g. logits of −inf) contribute 0, not NaN.

    Args:
      logits: `[B, T, V]` response-aligned logits, any float dtype (float32 math).
      temperature: `τ > 0`, the sampling temperature (SPEC §2).
      chunk_size: as in `token_logprobs`.

    Returns:
      `[B, T]` float32 entropies (nats).
    """
    fn = "entropy"
    logits = jnp.asarray(logits)
    if logits.ndim != 3 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `logits` must be a float array of shape [B, T, V], got "
            f"{logits.dtype}{list(logits.shape)}"
        )
    b, t, v = logits.shape
    _checks.positive(fn, "temperature", temperature)
    inv_tau = 1.0 / jnp.asarray(temperature, jnp.float32)

    def rows_entropy(logits_NxV):
        x = logits_NxV.astype(jnp.float32) * inv_tau
        m = lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        e = jnp.exp(x - m)
        s = jnp.sum(e, axis=-1)
        # Double `where`: a −inf logit must not reach the product, nor its gradient.
        centred = jnp.where(e > 0, x - m, 0.0)
        return jnp.log(s) - jnp.sum(e * centred, axis=-1) / s

    chunk = _chunk_rows(chunk_size, v)
    return _map_rows(rows_entropy, (logits.reshape(b * t, v),), chunk).reshape(b, t)


def shift_logits_for_response(logits: jax.Array, prompt_len: int) -> jax.Array:
    """Slices full-sequence outputs to the response axis (the SPEC §2 shift).

    For a sequence `s = prompt ⧺ response` of length `L = P + T`, the output at position
    `i` predicts `s[i + 1]`. Response token `t` sits at `P + t`, so it is predicted at
    `P + t − 1`: the response-aligned outputs are positions `P − 1 … L − 2`.

    The same shift applies to per-position critic values `[B, L]` (the value of the state
    whose logits predict `y_t`, SPEC §4), which is why any trailing axes are allowed.

    Args:
      logits: `[B, L, ...]` outputs over the whole sequence (e.g. `[B, L, V]` logits).
      prompt_len: `P ≥ 1`, the (left-padded) prompt length, a static int.

    Returns:
      `[B, T, ...]` with `T = L − P`, aligned with `response` `[B, T]`.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 2:
        raise ValueError(
            f"shift_logits_for_response: `logits` must have shape [B, L, ...], got {logits.shape}"
        )
    length = logits.shape[1]
    if not isinstance(prompt_len, int) or not 1 <= prompt_len < length:
        raise ValueError(
            f"shift_logits_for_response: `prompt_len` must be an int in [1, L) = [1, {length}), "
            f"got {prompt_len!r}"
        )
    return logits[:, prompt_len - 1 : length - 1]


def sequence_logprobs(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Log-probability of each whole response: `Σ_t m_t · logp_t` (used by DPO, SPEC §5).

    Args:
      logp: `[B, T]` response-aligned token log-probs.
      mask: `[B, T]` bool or float, 1 on valid response tokens.

    Returns:
      `[B]` float32.
    """
    fn = "sequence_logprobs"
    logp = _checks.float_array(fn, "logp", logp, ("B", "T"))
    mask = _checks.mask_like(fn, mask, ("B", "T"), "logp", logp.shape)
    return jnp.sum(jnp.where(mask, logp, 0.0), axis=1)
