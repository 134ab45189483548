"""Token log-probs and entropies straight from hidden states: the LM head fused in
(docs/concepts.md#shapes-masks-and-the-one-shift).

`token_logprobs(h @ W, y)` holds the `[B, T, V]` logits, and under `grad` their cotangent
too; at real sizes (V = 152k, T = 4k) that is most of a training step's memory.
`linear_logprobs` computes the same numbers from `h` and `W` a block of logits at a time:
the flattened `B·T` rows in chunks of `chunk_size`, and within a chunk the vocabulary in
blocks of `vocab_chunk_size` with an online logsumexp. Its backward pass (a `custom_vjp`)
recomputes each block of logits from the saved `h`, `W`, targets and per-row logsumexp
(and entropy), so neither pass holds more than a few `[chunk, vocab block]` arrays beyond
the inputs and the float32 accumulators of the gradients `dh` `[B·T, D]` and `dW` `[D, V]`.

The formulas (forward recurrences and the backward pass) are in `linear_logprobs`'s
docstring.

On tokamax (0.0.12, `tokamax.linear_softmax_cross_entropy_loss(x, labels, w)`): it fuses
the same head but returns only the reduced scalar `Σ_rows −logp` (or its mean), with no
temperature, no per-row weights or mask, no entropy, no greedy token, and its backward
takes one scalar cotangent for all rows. RL needs per-token log-probs (ratios, KL,
per-token advantages) and their per-token gradients, so it cannot serve `hidden_logprobs`.
Its "xla" implementation materialises the full `x @ w` logits anyway; its Mosaic kernel
runs only on TPU (rows a multiple of its 1024-row block). At most it could compute the
SFT loss on TPU when that loss is a token sum or token mean at τ = 1 (masked rows zeroed
in `x`), but not the per-sequence aggregation modes nor the token accuracy; it is not
used (no TPU to test it on here).

What XLA:CPU (jax 0.10) keeps, from `compile().memory_analysis()` (benchmarks/bench_lm_head.py)
at B=8, T=1024, D=896, V=151,936, where one float32 `[B, T, V]` copy is 4748 MiB: the
plain `project → token_logprobs + entropy` path holds 10164 MiB of temporaries in the
forward pass and 19780 MiB under `grad`; this one 46 MiB and 49 MiB for float32 inputs,
60 MiB and 555 MiB for bf16 (of which `D·V·4` = 519 MiB is the float32 `dW`
accumulator; for float32 that is the output itself), and at T = 4096 still 46 / 50 MiB
against 38,615 / 76,571 MiB. One XLA:CPU habit needed care: it has no bf16 dynamic-slice,
and converts the whole operand to float32 instead (then hoists that out of the loop), so
bf16 `W` is cut into blocks by static slices (`_columns`) and bf16 row chunks travel as
raw bits (`_bits`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrlhf.ops import _checks

# Logits one block holds by default: 2**22 (16 MiB as float32).
_BLOCK_ELEMENTS = 2**22
# Vocabularies up to this size are one block; larger ones use blocks of _VOCAB_BLOCK.
_WHOLE_VOCAB = 2**15
_VOCAB_BLOCK = 2**13


class LinearLogprobs(NamedTuple):
    """What `linear_logprobs` returns; the fields not asked for are None."""

    logp: jax.Array  # [B, T] float32
    entropy: jax.Array | None  # [B, T] float32
    argmax: jax.Array | None  # [B, T] int32, the greedy token (no gradient)


class _Plan(NamedTuple):
    """Static block sizes and outputs (hashable: a `custom_vjp` non-differentiable arg)."""

    vocab_block: int
    with_entropy: bool
    with_argmax: bool
    soft_cap: float | None = None


def _bits(x):
    """16-bit floats as raw bits, for the row loops (see `_columns`); float32 as is."""
    return x if x.dtype.itemsize == 4 else lax.bitcast_convert_type(x, jnp.uint16)


def _unbits(x, dtype):
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _columns(w_DxV, k, plan: _Plan):
    """Block `k` of `W`'s columns, `[D, Vb]`, starting at `min(k·Vb, V − Vb)`.

    XLA:CPU has no bf16 dynamic-slice: it would convert all of `W` to float32 first (a
    `D·V·4`-byte temporary). So 16-bit weights are cut by static slices, one branch of a
    `lax.switch` per block, each fused with its own upcast; float32 ones by `dynamic_slice`.
    """
    v, vb = w_DxV.shape[1], plan.vocab_block
    if w_DxV.dtype.itemsize == 4:
        return lax.dynamic_slice_in_dim(w_DxV, jnp.minimum(k * vb, v - vb), vb, axis=1)
    starts = [min(j * vb, v - vb) for j in range(-(-v // vb))]
    return lax.switch(k, [functools.partial(lambda s, w: w[:, s:s + vb], s) for s in starts], w_DxV)


def _logits(h_CxD, w_blk, inv_tau, plan: _Plan):
    """`z = cap(h @ w)/τ` in float32, `cap(x) = c·tanh(x/c)` with `plan.soft_cap` c."""
    x = (h_CxD @ w_blk).astype(jnp.float32)
    if plan.soft_cap is not None:
        x = plan.soft_cap * jnp.tanh(x / plan.soft_cap)
    return x * inv_tau


def _block(h_CxD, w_DxV, inv_tau, k, plan: _Plan):
    """Block `k` of the logits: `(z [C, Vb] float32, w block, column ids [Vb], valid [Vb] or
    None, start)`.

    The last block's start is clamped to `V − Vb` so that its slice stays inside `W` (no
    padded copy of `W`); its columns that the previous block already covered are invalid
    (`z = −inf`).
    """
    v, vb = w_DxV.shape[1], plan.vocab_block
    if vb == v:
        return _logits(h_CxD, w_DxV, inv_tau, plan), w_DxV, jnp.arange(v), None, 0
    start = jnp.minimum(k * vb, v - vb)
    w_blk = _columns(w_DxV, k, plan)
    cols = start + jnp.arange(vb)
    valid = cols >= k * vb
    return jnp.where(valid[None], _logits(h_CxD, w_blk, inv_tau, plan), -jnp.inf), w_blk, cols, valid, start


def _num_blocks(w_DxV, plan: _Plan) -> int:
    return -(-w_DxV.shape[1] // plan.vocab_block)


def _chunk_forward(h_CxD, w_DxV, y_C, inv_tau, plan: _Plan):
    """One row chunk: `(logp, lse, entropy or None, argmax or None)`, each `[C]`."""
    c = h_CxD.shape[0]
    f32 = jnp.float32

    def step(carry, k):
        m, s, a, zy, best = carry
        z, _, cols, valid, start = _block(h_CxD, w_DxV, inv_tau, k, plan)
        bm = jnp.max(z, axis=1)
        m_new = jnp.maximum(m, bm)
        alpha = jnp.exp(m - m_new)  # 0 on the first block (m = −inf)
        d = z - m_new[:, None]
        e = jnp.exp(d)
        s_new = s * alpha + jnp.sum(e, axis=1)
        if plan.with_entropy:
            # e·d is 0·(−inf) on masked columns: those contribute 0.
            ed = jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=1)
            a = jnp.where(s > 0, alpha * (a + (m - m_new) * s), 0.0) + ed
        mine = (y_C >= cols[0]) & (y_C <= cols[-1])
        if valid is not None:
            mine &= y_C >= k * plan.vocab_block
        picked = jnp.take_along_axis(z, jnp.clip(y_C - start, 0, z.shape[1] - 1)[:, None], axis=1)[:, 0]
        zy = jnp.where(mine, picked, zy)
        if plan.with_argmax:
            # Strictly greater: ties keep the earlier block, as `jnp.argmax` keeps the first.
            best = jnp.where(bm > m, start + jnp.argmax(z, axis=1).astype(jnp.int32), best)
        return (m_new, s_new, a, zy, best), None

    init = (jnp.full((c,), -jnp.inf, f32), jnp.zeros((c,), f32), jnp.zeros((c,), f32),
            jnp.zeros((c,), f32), jnp.zeros((c,), jnp.int32))
    n_blocks = _num_blocks(w_DxV, plan)
    if n_blocks == 1:
        (m, s, a, zy, best), _ = step(init, 0)
    else:
        (m, s, a, zy, best), _ = lax.scan(step, init, jnp.arange(n_blocks))
    log_s = jnp.log(s)
    lse = m + log_s
    ent = log_s - a / s if plan.with_entropy else None
    return zy - lse, lse, ent, (best if plan.with_argmax else None)


def _forward(h_NxCxD, w_DxV, y_NxC, inv_tau, plan: _Plan):
    # The row chunks travel as raw bits: XLA:CPU would upcast all of a bf16 `h` (`_columns`).
    dtype = h_NxCxD.dtype
    return lax.map(lambda xs: _chunk_forward(_unbits(xs[0], dtype), w_DxV, xs[1], inv_tau, plan),
                   (_bits(h_NxCxD), y_NxC))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(h_NxCxD, w_DxV, y_NxC, inv_tau, plan: _Plan):
    logp, _, ent, best = _forward(h_NxCxD, w_DxV, y_NxC, inv_tau, plan)
    return logp, ent, best


def _fused_fwd(h_NxCxD, w_DxV, y_NxC, inv_tau, plan: _Plan):
    logp, lse, ent, best = _forward(h_NxCxD, w_DxV, y_NxC, inv_tau, plan)
    return (logp, ent, best), (h_NxCxD, w_DxV, y_NxC, inv_tau, lse, ent)


def _fused_bwd(plan: _Plan, res, cts):
    h_NxCxD, w_DxV, y_NxC, inv_tau, lse_NxC, ent_NxC = res
    g_logp, g_ent, _ = cts
    dtype = h_NxCxD.dtype
    f32 = jnp.float32
    n_blocks = _num_blocks(w_DxV, plan)

    def row_chunk(dw_DxV, xs):
        h_CxD, y_C, lse_C, g_logp_C, ent_C, g_ent_C = xs
        h_CxD = _unbits(h_CxD, dtype)

        def block(carry, k):
            dh_CxD, dw_DxV = carry
            z, w_blk, cols, valid, start = _block(h_CxD, w_DxV, inv_tau, k, plan)
            logp_v = z - lse_C[:, None]
            p = jnp.exp(logp_v)  # 0 on masked columns
            hit = cols[None] == y_C[:, None]
            if valid is not None:
                hit &= valid[None]
            dz = jnp.where(hit, g_logp_C[:, None], 0.0) - g_logp_C[:, None] * p
            if plan.with_entropy:
                # −p·(log p + H), 0 where p = 0 (masked columns: 0·(−inf)).
                dz -= jnp.where(p > 0, g_ent_C[:, None] * p * (logp_v + ent_C[:, None]), 0.0)
            dz = dz * inv_tau
            if plan.soft_cap is not None:  # through c·tanh(x/c): × (1 − tanh²), tanh = z/(τ⁻¹·c); 0 if masked
                dz = jnp.where(jnp.isfinite(z), dz * (1.0 - jnp.square(z / (inv_tau * plan.soft_cap))), 0.0)
            dz = dz.astype(dtype)
            dh_CxD = dh_CxD + jnp.dot(dz, w_blk.T, preferred_element_type=f32)
            dw_blk = jnp.dot(h_CxD.T, dz, preferred_element_type=f32)
            if valid is None:
                dw_DxV = dw_DxV + dw_blk
            else:
                old = lax.dynamic_slice_in_dim(dw_DxV, start, plan.vocab_block, axis=1)
                dw_DxV = lax.dynamic_update_slice_in_dim(dw_DxV, old + dw_blk, start, axis=1)
            return (dh_CxD, dw_DxV), None

        init = (jnp.zeros(h_CxD.shape, f32), dw_DxV)
        if n_blocks == 1:
            (dh_CxD, dw_DxV), _ = block(init, 0)
        else:
            (dh_CxD, dw_DxV), _ = lax.scan(block, init, jnp.arange(n_blocks))
        return dw_DxV, _bits(dh_CxD.astype(dtype))

    zeros = jnp.zeros_like(lse_NxC)
    xs = (_bits(h_NxCxD), y_NxC, lse_NxC, g_logp,
          zeros if ent_NxC is None else ent_NxC, zeros if g_ent is None else g_ent)
    dw_DxV, dh_NxCxD = lax.scan(row_chunk, jnp.zeros(w_DxV.shape, f32), xs)
    d_y = np.zeros(y_NxC.shape, jax.dtypes.float0)
    return _unbits(dh_NxCxD, dtype), dw_DxV.astype(w_DxV.dtype), d_y, jnp.zeros_like(inv_tau)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _positive_int(fn: str, name: str, value) -> None:
    if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{fn}: `{name}` must be a positive int or None, got {value!r}")


def linear_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    with_entropy: bool = False,
    with_argmax: bool = False,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    soft_cap: float | None = None,
) -> LinearLogprobs:
    """Log-probability (and entropy) of each target under `softmax(cap(hidden @ w) / τ)`,
    without the `[B, T, V]` logits.

        z = cap(hidden[b, t] @ w)/τ          (matmul in the inputs' dtype, then float32)
        cap(x) = c·tanh(x/c) with `soft_cap` c (Gemma 2's final-logit soft-capping), else x
        logp[b, t] = z_y − logsumexp_v z_v,   y = targets[b, t]
        entropy[b, t] = logsumexp_v z_v − Σ_v p_v z_v = −Σ_v p_v log p_v,   p = softmax(z)

    Equal to `token_logprobs(hidden @ w, targets, τ)` and `entropy(hidden @ w, τ)` up to
    float rounding, with the memory of a few `[chunk_size, vocab_chunk_size]` blocks instead
    of `[B, T, V]` logits and their gradient. Rows (the flattened `B·T`) go in chunks; per
    row, the vocabulary blocks `k` keep a running max `m`, sum `s = Σ e^{z−m}` and
    `a = Σ e^{z−m}·(z − m)` (an online logsumexp):

        m' = max(m, max_k z)                  s' = s·e^{m−m'} + Σ_k e^{z−m'}
        a' = e^{m−m'}·(a + (m − m')·s) + Σ_k e^{z−m'}·(z − m')
        lse = m + log s      logp = z_y − lse      entropy = log s − a/s

    (`a` is taken about the running max, so the entropy is a difference of terms of size
    log V, not of size |z|.) The backward pass (a `custom_vjp`) recomputes each block of
    `z` from the saved `hidden`, `w`, targets, `lse` and entropy; with `p = softmax(z)`:

        ∂logp/∂z_v = 1[v = y] − p_v          ∂H/∂z_v = −p_v·(log p_v + H)
        dz = (ḡ_logp·∂logp/∂z + ḡ_H·∂H/∂z)/τ     dhidden = dz·wᵀ      dw = hiddenᵀ·dz

    (with a soft cap, `dz` also takes the factor `1 − tanh²(x/c) = 1 − (τ·z/c)²`)

    `dz` is cast to the inputs' dtype for the two matmuls; `dhidden` (over vocabulary
    blocks) and `dw` (over row chunks) are accumulated in float32 and cast back at the end.
    Differentiable in `hidden` and `w`; the temperature is held constant (`stop_gradient`:
    no gradient flows to it). For tied embeddings pass `w = embedding.T` `[D, V]`; its
    gradient arrives as the transpose.

    Args:
      hidden: `[B, T, D]` states that predict `targets` (e.g. the final norm's output,
        response-aligned), float32 or bf16.
      w: `[D, V]` the LM head, same dtype as `hidden`.
      targets: `[B, T]` integer token ids in `[0, V)`.
      temperature: `τ > 0`, a Python float or a traced scalar.
      with_entropy: also return the entropies.
      with_argmax: also return the greedy token `argmax_v z_v` (the first on ties), e.g.
        for a token accuracy; it costs one more reduction per block.
      chunk_size: rows of the flattened `B·T` processed at once; `None`: about
        `2**22 / vocab_chunk_size` (16 MiB of float32 logits per block), split evenly.
      vocab_chunk_size: vocabulary columns per block; `None`: all of `V` up to 32,768,
        else 8,192. Larger than `V` means `V`.
      soft_cap: `c > 0` caps the logits at ±c smoothly before the temperature, or None.

    Returns:
      `LinearLogprobs(logp, entropy, argmax)`: `[B, T]` float32 log-probs, `[B, T]` float32
      entropies (nats) or None, `[B, T]` int32 greedy tokens or None.
    """
    fn = "linear_logprobs"
    hidden, w = jnp.asarray(hidden), jnp.asarray(w)
    if hidden.ndim != 3 or not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise ValueError(f"{fn}: `hidden` must be a float array of shape [B, T, D], got "
                         f"{hidden.dtype}{list(hidden.shape)}")
    b, t, d = hidden.shape
    if w.ndim != 2 or w.shape[0] != d:
        raise ValueError(f"{fn}: `w` must have shape [D, V] with D = {d} like `hidden`, got {list(w.shape)}")
    if w.dtype != hidden.dtype:
        raise ValueError(f"{fn}: `w` ({w.dtype}) and `hidden` ({hidden.dtype}) must have one dtype, "
                         "the matmul's")
    targets = _checks.like(fn, "targets", targets, ("B", "T"), "hidden[..., 0]", (b, t))
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{fn}: `targets` must be an integer array, got dtype {targets.dtype}")
    _checks.positive(fn, "temperature", temperature)
    _positive_int(fn, "chunk_size", chunk_size)
    _positive_int(fn, "vocab_chunk_size", vocab_chunk_size)
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{fn}: `soft_cap` must be a positive float or None, got {soft_cap!r}")

    v, n = w.shape[1], b * t
    if vocab_chunk_size is None:
        vocab_chunk_size = v if v <= _WHOLE_VOCAB else _VOCAB_BLOCK
    vb = min(int(vocab_chunk_size), v)
    if chunk_size is None:
        chunks = -(-n // max(1, _BLOCK_ELEMENTS // vb))
        chunk_size = -(-n // chunks)  # as even as possible: the least padding
    c = min(int(chunk_size), n)
    n_chunks = -(-n // c)
    pad = n_chunks * c - n

    plan = _Plan(vb, bool(with_entropy), bool(with_argmax), None if soft_cap is None else float(soft_cap))
    inv_tau = lax.stop_gradient(1.0 / jnp.asarray(temperature, jnp.float32))
    h_NxD = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0)))
    y_N = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad))
    logp, ent, best = _fused(h_NxD.reshape(n_chunks, c, d), w, y_N.reshape(n_chunks, c), inv_tau, plan)
    unpad = lambda x: None if x is None else x.reshape(-1)[:n].reshape(b, t)
    return LinearLogprobs(unpad(logp), unpad(ent), unpad(best))
