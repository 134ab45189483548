"""Attention behind one function: `attend`, with implementations chosen by backend, length
and config.

Every implementation computes, for query `l` of row `b` and head `n` (kv head `k = n // G`,
`G = N / K` query heads per kv head, no keys or values repeated):

    o[b, l, n] = Σ_s softmax_s( cap(scale · q[b, l, n] · k[b, s, k])  where allowed(b, l, s) ) v[b, s, k]

    allowed(b, l, s) = key_valid[b, s] ∧ key_valid[b, query_slot[l]] ∧ s ≤ query_slot[l] ∧ s > query_slot[l] − window

`cap(x) = soft_cap · tanh(x / soft_cap)` with a soft cap (Gemma 2's attention-logit
soft-capping), else `x`.

`key_valid` `[B, S]` marks real tokens (left-padded prompts, right-padded responses, cache
slots not written yet are all False); `query_slot` `[L]` is each query's slot in the `S`
keys (`arange(L)` for a full forward, `cache_index + arange(L)` with a KV cache), so the
causal and local-window rules are on slot indices, as transformers applies them. A decode
step whose rows sit at different slots (continuous batching) gives `query_slot` `[B, L]`,
row b's own; every implementation then runs "dense" (its scores are `[B, N, L, S]`, for
L = 1 the size of a cache row). A query
with no allowed key — a padding query, whose own slot is not a real token, or a real one
with nothing real before it — gets a zero output in every implementation, with zero
gradient. No padding position ever reaches a real token's output (a padding slot is never
a valid key), so this only makes the implementations agree everywhere.

The mask is two linear-size arrays (`AttentionMask`), never `[B, L, S]`: at L = 16k one
boolean `[L, S]` mask alone is 256 MiB per row.

Implementations (`ModelConfig.attention`, names in `IMPLEMENTATIONS`):
- "dense": scores `[B, K, G·L, S]` in float32, the reference; quadratic memory.
- "chunked": online softmax over key blocks for blocks of queries, with a hand-written
  backward pass (`custom_vjp`) that recomputes each block's probabilities: O(L·block)
  memory in the forward and the backward pass, any backend. Key blocks wholly outside the
  causal/window band of a query block are skipped.
- "cudnn": cuDNN flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs,
  bf16/fp16), and "splash": the Pallas TPU splash attention that ships with JAX; both for
  self-attention passes (training, scoring), adapted in `_kernels`. Elsewhere (a decode
  step, queries against a cache) they resolve to "chunked". cuDNN takes no soft cap: with
  one, "cudnn" is refused and "auto" never picks it (splash applies the cap in-kernel).
- "auto" (default): dense where its score array is small (short sequences, decode steps);
  for longer self-attention splash on TPU, cuDNN on a GPU with bf16/fp16 compute; chunked
  otherwise. Splash is a Pallas call that GSPMD does not partition: over several chips it
  runs in a `shard_map` over the mesh that `kernel_mesh` names (the runs enter it from
  their mesh and rules; `parallel.kernel_mesh` for your own steps), and without one
  "auto" keeps the chunked form there.

`tokamax.dot_product_attention` was measured as the alternative for the chunked form: its
"xla_chunked" gradient took 230 MiB at L = 4,096 (9/3 heads) against 58 MiB here, and it
takes padding only as per-row lengths or a dense `[B, N, L, S]` mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrlhf.models import _kernels

IMPLEMENTATIONS = ("auto", "dense", "chunked", "cudnn", "splash")
_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}

# "auto" keeps the dense form while its float32 score array [B, K, G·L, S] has at most this
# many elements per (batch row, kv head): 2**18, e.g. L = S = 512 with no GQA (1 MiB). The chunked
# form is as fast or faster on XLA:CPU from there (forward + backward, measured at L = 512-2048).
_DENSE_MAX_SCORES = 2**18
_NEG = float(jnp.finfo(jnp.float32).min)


class AttentionMask(NamedTuple):
    """Which keys each query may attend to, in linear size (see the module docstring).

    key_valid: `[B, S]` bool, True on real tokens.
    query_slot: `[L]` int32, each query's slot among the `S` keys (queries are consecutive),
      or `[B, L]`: each row's own.
    """

    key_valid: jax.Array
    query_slot: jax.Array


class KernelMesh(NamedTuple):
    """Where a kernel that GSPMD cannot partition (splash) runs over several devices: the
    mesh, and the mesh axes that split the batch rows and the kv heads (from the sharding
    rules of `batch` and `kv_heads`)."""

    mesh: Any  # jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]


_KERNEL_MESH: contextvars.ContextVar[KernelMesh | None] = contextvars.ContextVar("kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh, *, batch_axes=(), head_axes=()):
    """Within this context, functions traced by `jax.jit` run the splash kernel per device
    of `mesh` (a `shard_map`; see `_kernels.splash`), and "auto" may choose it over
    several chips. Enter it around the calls that compile, with the mesh their inputs live on."""
    token = _KERNEL_MESH.set(KernelMesh(mesh, tuple(batch_axes), tuple(head_axes)))
    try:
        yield
    finally:
        _KERNEL_MESH.reset(token)


def current_kernel_mesh() -> KernelMesh | None:
    """The `KernelMesh` of the innermost `kernel_mesh` context, or None."""
    return _KERNEL_MESH.get()


def allowed_BxLxS(mask: AttentionMask, window: int | None) -> jax.Array:
    """The `[B, L, S]` boolean mask that `mask` stands for (dense form and tests only)."""
    s = mask.key_valid.shape[1]
    key_slot, q_slot = jnp.arange(s)[None, :], mask.query_slot[..., None]
    ok_LxS = key_slot <= q_slot
    if window is not None:
        ok_LxS &= key_slot > q_slot - window
    ok_BxLxS = ok_LxS if ok_LxS.ndim == 3 else ok_LxS[None]
    return mask.key_valid[:, None, :] & ok_BxLxS & _query_valid_BxL(mask)[:, :, None]


def _query_valid_BxL(mask: AttentionMask) -> jax.Array:
    """Whether each query's own slot holds a real token."""
    if mask.query_slot.ndim == 2:
        return jnp.take_along_axis(mask.key_valid.astype(bool), mask.query_slot, axis=1)
    return jnp.take(mask.key_valid.astype(bool), mask.query_slot, axis=1)


def capped(x: jax.Array, soft_cap: float | None) -> jax.Array:
    """`soft_cap · tanh(x / soft_cap)`, or `x` without a cap: Gemma 2's soft-capping of
    attention scores (here) and of the final logits (`transformer`)."""
    return x if soft_cap is None else soft_cap * jnp.tanh(x / soft_cap)


def dense(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask: AttentionMask, *, scale: float, window: int | None = None,
          soft_cap: float | None = None, keys_transposed: bool = False):
    """The reference: all scores `[B, K, G·L, S]` at once, softmax in float32.

    The scores' dot accumulates in float32 and stays there (as the chunked form's), never
    rounded to a bf16 compute dtype: a bf16 dot cast up is a round trip XLA may drop in one
    program and keep in another (`xla_allow_excess_precision`), so the same row rounded
    differently with other rows beside it — a decode step of a CPU row block against the
    whole batch, or the sampler against the trainer.

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
    spec = "BKQH,BKHS->BKQS" if keys_transposed else "BKQH,BKSH->BKQS"
    scores = jnp.einsum(spec, q_BxKxQxH, k_BxKxSxH.astype(dt), preferred_element_type=jnp.float32)
    scores = capped(scores * scale, soft_cap)
    allowed = allowed_BxLxS(mask, window)
    mask_BxQxS = jnp.broadcast_to(allowed[:, None], (b, g, l, s)).reshape(b, 1, g * l, s)
    # finfo.min rather than -inf: a fully masked row (a padding query) stays finite, and
    # is then zeroed.
    scores = jnp.where(mask_BxQxS, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1) * jnp.any(mask_BxQxS, axis=-1, keepdims=True)
    probs = probs.astype(dt)
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, v_BxKxSxH.astype(dt))
    return out.reshape(b, kh, g, l, h).transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)


def choose(implementation: str, *, num_queries: int, num_keys: int, num_groups: int,
           queries_are_keys: bool = False, dtype=jnp.float32, platform: str | None = None,
           soft_cap: float | None = None) -> str:
    """The implementation `attend` runs for `implementation` ("auto" resolved; a kernel
    that does not apply to these queries resolves to "chunked"; cuDNN, which cannot
    soft-cap scores, is refused with a `soft_cap` and never chosen by "auto")."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention={implementation!r}; expected one of {list(IMPLEMENTATIONS)}")
    if implementation == "cudnn" and soft_cap is not None:
        raise ValueError(f"attention='cudnn' cannot soft-cap attention scores (this model's "
                         f"attn_logit_softcapping={soft_cap}); use 'auto', 'chunked', 'dense' or 'splash'")
    platform = platform or jax.default_backend()
    if implementation in _PLATFORM:
        if platform != _PLATFORM[implementation]:
            raise ValueError(f"attention={implementation!r} needs a {_PLATFORM[implementation].upper()} backend; "
                             f"this one is {platform!r} (use 'auto', 'chunked' or 'dense')")
        if implementation == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"attention='cudnn' needs bfloat16 or float16 compute (model dtype), not {jnp.dtype(dtype)}")
        return implementation if queries_are_keys else "chunked"
    if implementation != "auto":
        return implementation
    if num_groups * num_queries * num_keys <= _DENSE_MAX_SCORES:
        return "dense"
    if queries_are_keys and platform == "tpu" and _splash_placeable():
        return "splash"
    if queries_are_keys and platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) \
            and soft_cap is None:
        return "cudnn"
    return "chunked"


def _splash_placeable() -> bool:
    """One chip, or a `kernel_mesh` over all of them: GSPMD would run an unpartitioned
    Pallas call on gathered inputs."""
    km = current_kernel_mesh()
    return jax.device_count() == 1 or (km is not None and km.mesh.size == jax.device_count())


def attend(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask: AttentionMask, *, implementation: str = "auto",
           scale: float, window: int | None = None, soft_cap: float | None = None, keys_transposed: bool = False,
           queries_are_keys: bool = False):
    """Attention of `q` over `S` keys under `mask` (see the module docstring for the formula).

    Args:
      q_BxLxNxH: queries (after RoPE), `N = G·K` heads.
      k_BxKxSxH: keys `[B, K, S, H]`, or `[B, K, H, S]` with `keys_transposed`.
      v_BxKxSxH: values `[B, K, S, H]`.
      mask: `AttentionMask(key_valid [B, S], query_slot [L] or per row [B, L])`; per-row
        slots always run "dense" (after `implementation` is validated).
      implementation: a name in `IMPLEMENTATIONS`.
      scale: the score scale (`head_dim ** -0.5`).
      window: a local window (keys within the last `window` slots of the query's), or None.
      soft_cap: scores become `soft_cap · tanh(score / soft_cap)` (after `scale`), or None.
      queries_are_keys: the queries are the keys' own slots (`S = L`, `query_slot =
        arange(L)`: a self-attention pass without a cache), where the kernels apply.

    Returns: `[B, L, N, H]` in the dtype of `q`.
    """
    _, l, n, _ = q_BxLxNxH.shape
    kh, s = v_BxKxSxH.shape[1], v_BxKxSxH.shape[2]
    queries_are_keys = queries_are_keys and not keys_transposed and s == l
    impl = choose(implementation, num_queries=l, num_keys=s, num_groups=n // kh, queries_are_keys=queries_are_keys,
                  dtype=q_BxLxNxH.dtype, soft_cap=soft_cap)
    if mask.query_slot.ndim == 2:  # each row at its own slots: the blocked forms share one slot per query
        impl = "dense"
    if impl == "splash":
        return _kernels.splash(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask.key_valid, scale=scale, window=window,
                               soft_cap=soft_cap, mesh=current_kernel_mesh())
    if impl == "cudnn":
        fallback = functools.partial(chunked, q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask, scale=scale, window=window)
        return _kernels.span_rotated(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask.key_valid, scale=scale, window=window,
                                     implementation="cudnn", fallback=fallback)
    if impl == "dense":
        return dense(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask, scale=scale, window=window, soft_cap=soft_cap,
                     keys_transposed=keys_transposed)
    if impl == "chunked":
        return chunked(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask, scale=scale, window=window, soft_cap=soft_cap,
                       keys_transposed=keys_transposed)
    raise NotImplementedError(f"attention={impl!r}")


# ----------------------------------------------------------------------------- chunked

_Q_BLOCK = 256
_K_BLOCK = 256


def chunked(q_BxLxNxH, k_BxKxSxH, v_BxKxSxH, mask: AttentionMask, *, scale: float, window: int | None = None,
            soft_cap: float | None = None, keys_transposed: bool = False, q_block: int = _Q_BLOCK, k_block: int = _K_BLOCK):
    """Memory-efficient attention (Rabe & Staats 2021; FlashAttention's online softmax).

    For each block of `q_block` queries, a loop over the key blocks that the causal and
    window rules leave reachable keeps a running max `m`, normaliser `ℓ` and output
    accumulator:

        m' = max(m, max_c s_c),  ℓ' = ℓ·e^{m−m'} + Σ_c p_c,  acc' = acc·e^{m−m'} + Σ_c p_c v_c,
        p_c = e^{s_c − m'} where allowed else 0;   o = acc / ℓ,  lse = m + log ℓ.

    The backward pass (`custom_vjp`) recomputes `p = e^{s − lse}` block by block from the
    saved `q, k, v, o, lse`: with `D = Σ_h dO·o`,

        dv += pᵀ dO,   ds = p ⊙ (dO vᵀ − D) · scale,   dq += ds k,   dk += dsᵀ q.

    With a soft cap the scores `s = c·tanh(x/c)` and `ds` takes the factor
    `ds/dx = 1 − (s/c)²` (the derivative of tanh, from the recomputed capped score).

    Memory is O(L·(q_block + H)) for the scores and O(S·H) for the key/value gradients,
    forward and backward; nothing of size L×S. Same arguments and result as `dense`.
    """
    b, l, n, h = q_BxLxNxH.shape
    kh, s = v_BxKxSxH.shape[1], v_BxKxSxH.shape[2]
    g = n // kh
    keys = k_BxKxSxH.transpose(0, 1, 3, 2) if keys_transposed else k_BxKxSxH
    bq, bk = min(q_block, l), min(k_block, s)
    lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
    q_BxKxGxLxH = q_BxLxNxH.reshape(b, l, kh, g, h).transpose(0, 2, 3, 1, 4)
    q_slot = mask.query_slot.astype(jnp.int32)
    if lp != l:  # padded queries repeat the last slot; their rows are cut off below
        q_BxKxGxLxH = jnp.pad(q_BxKxGxLxH, ((0, 0),) * 3 + ((0, lp - l), (0, 0)))
        q_slot = jnp.concatenate([q_slot, jnp.broadcast_to(q_slot[-1:], (lp - l,))])
    key_valid = mask.key_valid.astype(bool)
    values = v_BxKxSxH
    if sp != s:  # padded keys are never valid
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
        values = jnp.pad(values, ((0, 0), (0, 0), (0, sp - s), (0, 0)))
        key_valid = jnp.pad(key_valid, ((0, 0), (0, sp - s)))
    out = _flash(q_BxKxGxLxH, keys, values.astype(keys.dtype), key_valid, q_slot,
                 _Static(float(scale), window, None if soft_cap is None else float(soft_cap), bq, bk))
    out = out[:, :, :, :l].transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)
    return jnp.where(_query_valid_BxL(mask)[:, :, None, None], out, 0).astype(q_BxLxNxH.dtype)


class _Static(NamedTuple):
    scale: float
    window: int | None
    soft_cap: float | None
    bq: int
    bk: int


def _key_block_range(slots_Q: jax.Array, st: _Static, num_k_blocks: int):
    """The key blocks `[lo, hi)` that hold any key a block of query slots may attend to."""
    hi = jnp.minimum(slots_Q[-1] // st.bk + 1, num_k_blocks)
    lo = 0 if st.window is None else jnp.maximum(slots_Q[0] - st.window + 1, 0) // st.bk
    return lo, jnp.maximum(hi, lo)


def _block_scores(q_BxKxGxQxH, k_BxKxCxH, valid_BxC, slots_Q, j, st: _Static):
    """Scaled float32 scores of one (query block, key block) pair and where they are allowed."""
    s = capped(jnp.einsum("BKGQH,BKCH->BKGQC", q_BxKxGxQxH, k_BxKxCxH, preferred_element_type=jnp.float32)
                * st.scale, st.soft_cap)
    key_slot_C = j * st.bk + jnp.arange(st.bk)
    ok_QxC = key_slot_C[None, :] <= slots_Q[:, None]
    if st.window is not None:
        ok_QxC &= key_slot_C[None, :] > slots_Q[:, None] - st.window
    allowed = valid_BxC[:, None, None, None, :] & ok_QxC[None, None, None]
    return jnp.where(allowed, s, _NEG), allowed


def _key_block(q_BxKxGxQxH, k, v, key_valid, slots_Q, j, st: _Static):
    """Key block `j`: its keys and values `[B, K, C, H]`, and its scores against the query
    block with where they are allowed (`_block_scores`)."""
    k_blk = lax.dynamic_slice_in_dim(k, j * st.bk, st.bk, axis=2)
    v_blk = lax.dynamic_slice_in_dim(v, j * st.bk, st.bk, axis=2)
    valid = lax.dynamic_slice_in_dim(key_valid, j * st.bk, st.bk, axis=1)
    return (k_blk, v_blk) + _block_scores(q_BxKxGxQxH, k_blk, valid, slots_Q, j, st)


def _split_queries(x_BxKxGxLx_, bq):
    b, kh, g, lp = x_BxKxGxLx_.shape[:4]
    return jnp.moveaxis(x_BxKxGxLx_.reshape(b, kh, g, lp // bq, bq, *x_BxKxGxLx_.shape[4:]), 3, 0)


def _merge_queries(x_NxBxKxGxQx_):
    nq, b, kh, g, bq = x_NxBxKxGxQx_.shape[:5]
    return jnp.moveaxis(x_NxBxKxGxQx_, 0, 3).reshape(b, kh, g, nq * bq, *x_NxBxKxGxQx_.shape[5:])


def _flash_forward(q, k, v, key_valid, q_slot, st: _Static):
    """`(o [B, K, G, L, H] float32, lse [B, K, G, L] float32)`; L and S are block multiples."""
    b, kh, g, lp, h = q.shape
    nk = k.shape[2] // st.bk

    def one_query_block(xs):
        q_blk, slots = xs

        def body(j, carry):
            m, ell, acc = carry
            k_blk, v_blk, sc, allowed = _key_block(q_blk, k, v, key_valid, slots, j, st)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.where(allowed, jnp.exp(sc - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("BKGQC,BKCH->BKGQH", p.astype(v.dtype), v_blk,
                                                     preferred_element_type=jnp.float32)
            return m_new, ell * corr + jnp.sum(p, axis=-1), acc

        lo, hi = _key_block_range(slots, st, nk)
        init = (jnp.full((b, kh, g, st.bq), _NEG, jnp.float32), jnp.zeros((b, kh, g, st.bq), jnp.float32),
                jnp.zeros((b, kh, g, st.bq, h), jnp.float32))
        m, ell, acc = lax.fori_loop(lo, hi, body, init)
        empty = ell == 0.0  # no allowed key: output 0, and an lse that zeroes p in the backward
        o = acc / jnp.where(empty, 1.0, ell)[..., None]
        return o, jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, ell)))

    o, lse = lax.map(one_query_block, (_split_queries(q, st.bq), q_slot.reshape(-1, st.bq)))
    return _merge_queries(o), _merge_queries(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, key_valid, q_slot, st: _Static):
    return _flash_forward(q, k, v, key_valid, q_slot, st)[0]


def _flash_fwd(q, k, v, key_valid, q_slot, st: _Static):
    o, lse = _flash_forward(q, k, v, key_valid, q_slot, st)
    return o, (q, k, v, key_valid, q_slot, o, lse)


def _flash_bwd(st: _Static, res, do):
    q, k, v, key_valid, q_slot, o, lse = res
    nk = k.shape[2] // st.bk
    do = do.astype(jnp.float32)
    d_BxKxGxL = jnp.sum(do * o, axis=-1)

    def one_query_block(carry, xs):
        dk, dv = carry
        q_blk, do_blk, lse_blk, d_blk, slots = xs

        def body(j, inner):
            dq, dk, dv = inner
            k_blk, v_blk, sc, allowed = _key_block(q_blk, k, v, key_valid, slots, j, st)
            p = jnp.where(allowed, jnp.exp(sc - lse_blk[..., None]), 0.0)
            dv_blk = jnp.einsum("BKGQC,BKGQH->BKCH", p, do_blk)
            dp = jnp.einsum("BKGQH,BKCH->BKGQC", do_blk, v_blk.astype(jnp.float32))
            ds = p * (dp - d_blk[..., None]) * st.scale
            if st.soft_cap is not None:  # d(c·tanh(x/c))/dx = 1 − tanh², zero where not allowed
                ds = ds * jnp.where(allowed, 1.0 - jnp.square(sc / st.soft_cap), 0.0)
            dq = dq + jnp.einsum("BKGQC,BKCH->BKGQH", ds, k_blk.astype(jnp.float32))
            dk_blk = jnp.einsum("BKGQC,BKGQH->BKCH", ds, q_blk.astype(jnp.float32))
            add = lambda acc, x: lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, j * st.bk, st.bk, axis=2) + x, j * st.bk, axis=2)
            return dq, add(dk, dk_blk), add(dv, dv_blk)

        lo, hi = _key_block_range(slots, st, nk)
        dq, dk, dv = lax.fori_loop(lo, hi, body, (jnp.zeros(q_blk.shape, jnp.float32), dk, dv))
        return (dk, dv), dq

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    xs = (_split_queries(q, st.bq), _split_queries(do, st.bq), _split_queries(lse, st.bq),
          _split_queries(d_BxKxGxL, st.bq), q_slot.reshape(-1, st.bq))
    (dk, dv), dq = lax.scan(one_query_block, init, xs)
    return (_merge_queries(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
