"""QLoRA's frozen base: the decoder's projection kernels stored quantised, de-quantised inside
the matmul (`projection.Projection`), while the LoRA adapters stay float32 (Dettmers et al. 2023).

Two kinds (`ModelConfig.quantize`):
- "int8": symmetric, one absmax scale per output channel: `w ≈ codes · scale`, codes in
  [-127, 127], `scale = max|w| / 127` over the column (error ≤ scale / 2 per element).
- "nf4": 4-bit NormalFloat, blockwise absmax over blocks of 64 input rows of a column:
  `w ≈ NF4_CODES[code] · absmax`, each value rounded to its nearest code; two codes packed
  in one byte.

A quantised kernel is a dict `{"codes", "scales"}` in the params pytree where the float
`kernel` was, laid out as the Projection multiplies it, 2-D `[K, M]` (K the product of the
kernel's input axes, M of its output axes; a scanned stack adds its leading layer axis):
int8 codes `[K, M]` int8 with scales `[1, M]` float32; NF4 codes `[K/2, M]` uint8 (rows
2i, 2i+1 in one byte) with scales `[ceil(K/64), M]` float32. The codes carry the kernel's
leading input and output axis names (splitting a merged axis in blocks = splitting its
leading axis), the scales its output axis, so the sharding rules place them like the
kernel. Every layer projection (q/k/v/o, gate/up/down) is quantised, adapted or not, as in
the QLoRA paper; embeddings, norms and the LM head stay float.

Why not `qwix` (Google's JAX quantisation library, which Tunix uses): its `quantize_api` /
`dequantize` are pure and its `QArray` is a pytree, but it stores NF4 as `uint4`, one byte
per code on CPU/GPU (no memory saved over int8), and orbax's tensorstore refuses `uint4`
("Unsupported data type"), so a QArray tree cannot be checkpointed (qwix 0.1.8, checked).
The kernels below are ~60 lines of `jnp` with nothing to intercept.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

KINDS = ("none", "int8", "nf4")
NF4_BLOCK = 64
# The NF4 code book (QLoRA, appendix E): quantiles of N(0, 1) normalised to [-1, 1], exact 0.
NF4_CODES = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)


def check_kind(kind: str, *, rank: int | None = None, field: str = "model.lora.quantize") -> str:
    """`kind` if it is one of `KINDS` (and, given the LoRA `rank`, that rank is > 0 when it
    quantises: only adapters train on a quantised base); else an error naming `field`."""
    if kind not in KINDS:
        raise ValueError(f"{field}={kind!r}: expected one of {', '.join(KINDS)}")
    if kind != "none" and rank is not None and rank <= 0:
        raise ValueError(f"{field}={kind!r} quantises the frozen base of a LoRA run, but model.lora.rank={rank}: "
                         "set model.lora.rank > 0 (the quantised base is never trained) or quantize=none")
    return kind


def is_quantized(node) -> bool:
    """Whether a params leaf/node is a quantised kernel (`{"codes", "scales"}`)."""
    return isinstance(node, Mapping) and "codes" in node


def _blocks(x_KxM: jax.Array, fill: float) -> jax.Array:
    """`[..., K, M] -> [..., ceil(K/64), 64, M]`, the K axis padded with `fill`."""
    k = x_KxM.shape[-2]
    pad = -k % NF4_BLOCK
    x = jnp.pad(x_KxM, [(0, 0)] * (x_KxM.ndim - 2) + [(0, pad), (0, 0)], constant_values=fill)
    return x.reshape(*x.shape[:-2], -1, NF4_BLOCK, x.shape[-1])


def quantize(w_KxM: jax.Array, kind: str) -> dict:
    """A float kernel `[..., K, M]` -> `{"codes", "scales"}` of `kind` ("int8" or "nf4")."""
    w = jnp.asarray(w_KxM, jnp.float32)
    if kind == "int8":
        scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0
        codes = jnp.round(w / jnp.where(scale == 0, 1.0, scale))
        return {"codes": jnp.clip(codes, -127, 127).astype(jnp.int8), "scales": scale}
    if kind != "nf4":
        raise ValueError(f"quantize: kind={kind!r}; expected int8 or nf4")
    if w.shape[-2] % 2:
        raise ValueError(f"quantize: nf4 packs two input rows per byte; the kernel's input size {w.shape[-2]} is odd")
    absmax = jnp.max(jnp.abs(_blocks(w, 0.0)), axis=-2)  # [..., nb, M]
    per_row = jnp.repeat(jnp.where(absmax == 0, 1.0, absmax), NF4_BLOCK, axis=-2)[..., :w.shape[-2], :]
    mids = (NF4_CODES[1:] + NF4_CODES[:-1]) / 2  # nearest code = how many midpoints lie below
    codes = jnp.searchsorted(jnp.asarray(mids), w / per_row).astype(jnp.uint8)
    return {"codes": codes[..., 0::2, :] | (codes[..., 1::2, :] << 4), "scales": absmax}


def dequantize(q: Mapping, dtype=jnp.float32) -> jax.Array:
    """`{"codes", "scales"}` -> the float kernel `[..., K, M]` in `dtype` (computed in float32)."""
    codes, scales = q["codes"], q["scales"]
    if codes.dtype == jnp.int8:
        return (codes.astype(jnp.float32) * scales).astype(dtype)
    unpacked = jnp.stack([codes & 15, codes >> 4], axis=-2)  # [..., K/2, 2, M]
    idx = unpacked.reshape(*codes.shape[:-2], 2 * codes.shape[-2], codes.shape[-1])
    k = idx.shape[-2]
    per_row = jnp.repeat(scales, NF4_BLOCK, axis=-2)[..., :k, :]
    return (jnp.asarray(NF4_CODES)[idx.astype(jnp.int32)] * per_row).astype(dtype)


_quantize_jit = jax.jit(quantize, static_argnums=1)
_dequantize_jit = jax.jit(dequantize, static_argnums=1)


def kernel_init(init, kind: str, axes: tuple, n_in: int):
    """The init of a quantised `Projection` kernel: `init` (the float one) drawn as
    `[in..., out...]`, quantised as `[K, M]`, each part boxed with its logical axes (codes:
    the kernel's first input and first output axis names; scales: its output axis)."""

    def make(rng, shape, dtype):
        k = int(np.prod(shape[:n_in]))
        q = quantize(init(rng, shape, dtype).reshape(k, -1), kind)
        return {"codes": nn.LogicallyPartitioned(q["codes"], (axes[0], axes[n_in])),
                "scales": nn.LogicallyPartitioned(q["scales"], (None, axes[n_in]))}

    return make


def _abstract(model) -> PyTree:
    return jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]))


def float_model(model):
    """`model` without adapters nor quantisation: the model of merged or de-quantised params
    (what a Hugging Face export holds)."""
    return type(model)(model.config.replace(lora=None, quantize="none"), head=model.head)


def _map_kernels(params: Mapping, abstract: Mapping, fn) -> dict:
    """`params` with `fn(kernel, abstract_kernel)` at every `kernel` whose abstract counterpart
    (or value) is quantised; nested dicts copied, other arrays shared."""
    out = {}
    for k, v in params.items():
        a = abstract.get(k) if isinstance(abstract, Mapping) else None
        if k == "kernel" and (is_quantized(a) or is_quantized(v)):
            out[k] = fn(v, a)
        elif isinstance(v, Mapping) and not is_quantized(v):
            out[k] = _map_kernels(v, a or {}, fn)
        else:
            out[k] = v
    return out


def quantize_base(model, params: PyTree) -> PyTree:
    """Float `params` with every layer projection's kernel quantised as `model.config.quantize`
    says (adapters, norms, embeddings and LM head as they are); `params` unchanged when it is
    "none". `model` is the quantising model (its init gives each kernel's `[K, M]` layout)."""
    kind = model.config.quantize
    if kind == "none":
        return params
    def fn(w, a):
        if is_quantized(w):
            return w
        lead = a["codes"].ndim - 2  # 1 for a scanned stack's layer axis
        return _quantize_jit(w.reshape(*w.shape[:lead], -1, a["codes"].shape[-1]), kind)

    return _map_kernels(params, _abstract(model), fn)


def dequantize_base(model, params: PyTree) -> PyTree:
    """`params` with every quantised kernel de-quantised to its float shape and param dtype
    (`float_model(model)`'s), e.g. before merging adapters or exporting; unchanged without any."""
    if not has_quantized(params):
        return params
    return _map_kernels(params, _abstract(float_model(model)),
                        lambda q, a: _dequantize_jit(q, jnp.dtype(a.dtype)).reshape(a.shape) if is_quantized(q) else q)


def _nodes(params: Mapping):
    for v in params.values():
        if isinstance(v, Mapping):
            yield v
            if not is_quantized(v):
                yield from _nodes(v)


def has_quantized(params: PyTree) -> bool:
    """Whether `params` holds any quantised kernel."""
    return any(is_quantized(n) for n in _nodes(params))
