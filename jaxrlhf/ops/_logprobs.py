"""Token log-probabilities and entropies from logits
(docs/concepts.md#shapes-masks-and-the-one-shift).

For a large vocabulary the `[B, T, V]` logits dominate memory, so neither function may
materialise a float32 `[B, T, V]` array in its forward pass: a log-prob is the gathered
logit minus a logsumexp, and the entropy is written in the one form XLA fuses whole.

What XLA:CPU (jax 0.10) keeps is subtle; measured with `compile().memory_analysis()` at
B=8, T=512, V=151,936, where one float32 copy of the logits is 2374 MiB
(benchmarks/bench_ops.py has the numbers):

- A float32 upcast feeding one reduction is fused into it; feeding two (the max and the
  sum of a logsumexp) it is materialised whole. So the sum reads the logits through an
  `optimization_barrier`, which XLA cannot merge with the max's read.
- XLA:CPU has no bf16 gather or dynamic-slice: it converts the *whole* operand to
  float32 first. So target logits and bf16 chunks are moved as raw bits (`_take_bits`,
  `_time_slice`): exact, and bf16 stays bf16.

With both, `token_logprobs` holds no temporary beyond `[B, T]` (float32 or bf16 logits,
no chunking needed). The entropy's plain `softmax · log_softmax` form is fused whole in
the forward pass but not in the backward pass, so `entropy` runs over chunks of
positions to bound both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrlhf.ops import _checks

# Logits one entropy chunk may hold: 2**26 (256 MiB as float32).
_CHUNK_ELEMENTS = 2**26

def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@jax.custom_jvp
def _take_bits(x_BxTxV: jax.Array, index_BxT: jax.Array) -> jax.Array:
    """`x[b, t, index[b, t]]`, gathered as raw bits (see the module docstring)."""
    picked = jnp.take_along_axis(_bits(x_BxTxV), index_BxT[..., None], axis=-1)[..., 0]
    return lax.bitcast_convert_type(picked, x_BxTxV.dtype)


@_take_bits.defjvp
def _take_bits_jvp(primals, tangents):
    x, index = primals
    dx, _ = tangents
    return _take_bits(x, index), jnp.take_along_axis(dx, index[..., None], axis=-1)[..., 0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _time_slice(x_BxTxV: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """`x[:, start : start + size]`, sliced as raw bits (see the module docstring)."""
    out = lax.dynamic_slice_in_dim(_bits(x_BxTxV), start, size, axis=1)
    return lax.bitcast_convert_type(out, x_BxTxV.dtype)


@_time_slice.defjvp
def _time_slice_jvp(size, primals, tangents):
    x, start = primals
    dx, _ = tangents
    return _time_slice(x, start, size), lax.dynamic_slice_in_dim(dx, start, size, axis=1)


def _logsumexp_f32(x: jax.Array, inv_tau: jax.Array) -> jax.Array:
    """`logsumexp(float32(x)·inv_tau)` over the last axis, with each pass's upcast fused."""
    m = lax.stop_gradient(jnp.max(x.astype(jnp.float32) * inv_tau, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # all −inf row: log(0) = −inf, not NaN
    x2 = lax.optimization_barrier(x)
    s = jnp.sum(jnp.exp(x2.astype(jnp.float32) * inv_tau - m), axis=-1)
    return m[..., 0] + jnp.log(s)


def _map_time_chunks(fn: Callable, x_BxTxV: jax.Array, chunk: int) -> jax.Array:
    """Applies `fn` (`[B, C, V]` -> `[B, C]`) to `chunk` positions at a time.

    Full chunks run under `lax.map` with `jax.checkpoint`, so that the backward pass also
    recomputes one chunk at a time instead of saving every chunk's softmax; the remainder
    (`T % chunk` positions) is one more slice, so the logits are never padded (a copy).
    """
    b, t, _ = x_BxTxV.shape
    if t <= chunk:
        return fn(x_BxTxV)
    n_full, rem = divmod(t, chunk)
    # Raw bits only for 16-bit floats: for float32 the bit view is itself a full copy
    # (the loop's operand), and float32 needs no workaround.
    narrow = x_BxTxV.dtype.itemsize < 4
    slice_ = _time_slice if narrow else functools.partial(lax.dynamic_slice_in_dim, axis=1)

    @jax.checkpoint
    def one_chunk(i):
        return fn(slice_(x_BxTxV, i * chunk, chunk))

    out_NxBxC = lax.map(one_chunk, jnp.arange(n_full))
    out = jnp.moveaxis(out_NxBxC, 0, 1).reshape(b, n_full * chunk)
    if rem:
        out = jnp.concatenate([out, fn(slice_(x_BxTxV, n_full * chunk, rem))], axis=1)
    return out


def _check_logits(fn: str, logits) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim != 3 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `logits` must be a float array of shape [B, T, V], got "
            f"{logits.dtype}{list(logits.shape)}"
        )
    return logits


def token_logprobs(
    logits: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
) -> jax.Array:
    """Log-probability of each target token under `softmax(logits / τ)`.

        logp[b, t] = logits[b, t, y]/τ − logsumexp_v(logits[b, t, v]/τ),   y = targets[b, t]

    `logits` must already be aligned with `targets` (see `shift_logits_for_response`), and
    the same temperature as the sampler's must be used everywhere. No float32
    `[B, T, V]` array is created, for float32 or bf16 logits (see the module docstring).

    Args:
      logits: `[B, T, V]` response-aligned logits, any float dtype (float32 math).
      targets: `[B, T]` integer token ids in `[0, V)`.
      temperature: `τ > 0`, dividing the logits.

    Returns:
      `[B, T]` float32 log-probabilities.
    """
    fn = "token_logprobs"
    logits = _check_logits(fn, logits)
    b, t, v = logits.shape
    targets = _checks.like(fn, "targets", targets, ("B", "T"), "logits[..., 0]", (b, t))
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{fn}: `targets` must be an integer array, got dtype {targets.dtype}")
    _checks.positive(fn, "temperature", temperature)
    inv_tau = 1.0 / jnp.asarray(temperature, jnp.float32)

    # [B, T, V] kept as is: reshaping the parameter to [B·T, V] cost a float32 copy.
    picked = _take_bits(logits, targets).astype(jnp.float32) * inv_tau
    return picked - _logsumexp_f32(logits, inv_tau)


def entropy(
    logits: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
) -> jax.Array:
    """Entropy of `p = softmax(logits / τ)` at every position.

        H[b, t] = −Σ_v p_v log p_v

    Entries with `p_v = 0` (e.g. logits of −inf) contribute 0, not NaN.

    Args:
      logits: `[B, T, V]` response-aligned logits, any float dtype (float32 math).
      temperature: `τ > 0`, the sampling temperature.
      chunk_size: response positions processed at once; `None` picks the largest chunk
        of at most 2**26 logits (256 MiB as float32; 55 positions at B=8, V=151,936, one
        piece for small vocabularies). In one piece XLA fuses the forward pass with no
        float32 temporary, but the backward pass then holds two float32 `[B, T, V]`
        arrays; chunks bound both (at B=8, T=512, V=151,936, float32: 0 / 4748 MiB in
        one piece, 594 / 1187 MiB with 64 positions, forward / under grad).

    Returns:
      `[B, T]` float32 entropies (nats).
    """
    fn = "entropy"
    logits = _check_logits(fn, logits)
    b, t, v = logits.shape
    _checks.positive(fn, "temperature", temperature)
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // (b * v))
    elif not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: `chunk_size` must be a positive int or None, got {chunk_size!r}")
    inv_tau = 1.0 / jnp.asarray(temperature, jnp.float32)

    def chunk_entropy(logits_BxCxV):
        # The plain softmax·log_softmax form is the one XLA fuses completely (no float32
        # temporary). A −inf logit is clamped to −1e30 first, so that p·log p is 0·finite
        # (0), not 0·(−inf) (NaN); the clamp keeps p = 0 for it.
        x = jnp.maximum(logits_BxCxV.astype(jnp.float32) * inv_tau, -1e30)
        return -jnp.sum(jax.nn.softmax(x, axis=-1) * jax.nn.log_softmax(x, axis=-1), axis=-1)

    return _map_time_chunks(chunk_entropy, logits, chunk_size)


def shift_logits_for_response(logits: jax.Array, prompt_len: int) -> jax.Array:
    """Slices full-sequence outputs to the response axis (the shift,
    docs/concepts.md#shapes-masks-and-the-one-shift).

    For a sequence `s = prompt ⧺ response` of length `L = P + T`, the output at position
    `i` predicts `s[i + 1]`. Response token `t` sits at `P + t`, so it is predicted at
    `P + t − 1`: the response-aligned outputs are positions `P − 1 … L − 2`.

    The same shift applies to per-position critic values `[B, L]` (the value of the state
    whose logits predict `y_t`), which is why any trailing axes are allowed.

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
    """Log-probability of each whole response: `Σ_t m_t · logp_t` (used by DPO,
    docs/concepts.md#preference-losses).

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
