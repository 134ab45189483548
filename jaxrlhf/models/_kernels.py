"""Accelerator attention kernels, adapted to `attention.attend`'s mask and layout.

Both kernels serve self-attention over one sequence (queries are the keys' own slots
`0 .. L−1`: training and scoring passes), where the field's kernels are fastest; decode
steps and cached queries use the dense or chunked forms.

- `splash`: the Pallas TPU splash attention that ships with JAX
  (`jax.experimental.pallas.ops.tpu.splash_attention`), its MQA kernel mapped over batch
  rows and kv heads (GQA without repeated keys). Padding is expressed as segment ids
  (`key_valid` for queries and keys alike): a real query attends to real keys at or
  before its slot, exactly `allowed`; a padding query attends to padding keys and is then
  zeroed. Runs in Pallas interpret mode off TPU, which is how the tests check it here.
  A Pallas call is one program that GSPMD does not partition, so over several chips it
  runs inside a `shard_map` (`attention.KernelMesh`): each device takes its rows of the
  batch and its kv heads (with their query heads) whole, as the run's sharding rules
  split them; attention never mixes rows or kv groups, so no device needs another's data.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN flash attention,
  NVIDIA GPUs, bf16/fp16). cuDNN takes only per-row lengths (`[0, n)` spans), so each row
  is rotated until its first real token sits at slot 0 — causal order is kept, a left-
  padded prompt followed by a right-padded response becomes one right-padded span — and
  rotated back after. Rows whose real tokens are not one contiguous span (never produced
  by this library's batching, but allowed by the mask) send the whole call to the chunked
  form, decided on device (`lax.cond`), so the result is always exact. The same glue runs
  with `implementation="xla"` in the tests.

Compiler choices per backend live here too: `decode_compiler_options` says which XLA
options a program that decodes a few rows per step should be compiled with, and
`vocab_major_decode_head` which form its LM head's dot takes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

_SPLASH_BLOCK = 128  # the splash kernel's default block; L is padded to a multiple of it

# XLA:CPU hands each dot to YNNPACK by default (`xla_cpu_experimental_ynn_fusion_type`
# holds INDIVIDUAL_DOT and REDUCE). Keeping only REDUCE sends the dots back to XLA's own
# (Eigen) emitter. Measured on 2 cores, jax 0.10.2 (docs/benchmarks.md, "Decode-step dots
# on XLA:CPU"), with weights that stream from memory (SmolLM2-135M's 513 MiB): on an AMD
# EPYC with AVX2 only (family 23), 30 layers of its seven projections on [M, 576] rows take
# 87 against 46 ms at M = 8 and 129 against 70 at M = 16, tie at 32 and lose 12-18 % from
# 64, and whole `generate` calls gain ~10 %; on one with AVX-512 (family 26) YNNPACK's are
# the faster ones (16.6 against 15.3 ms at M = 8, but `generate` 1.60 against 1.97 s at B
# = 8 × 64 tokens, 2.25 against 2.70 s at B = 16). With the workload's 12 MiB model (its
# weights fit in cache) YNNPACK's dots win everywhere.
_CPU_FEW_ROW_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_REDUCE"),)
_CPU_FEW_ROWS = 32
_CPU_STREAMED_WEIGHT_BYTES = 64 * 2**20


@functools.lru_cache(maxsize=None)
def _accepted(options: tuple) -> bool:
    """Whether this jaxlib compiles with `options` (an experimental flag may go away)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(jnp.zeros((), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - any refusal means "do not use them"
        return False
    return True


@functools.lru_cache(maxsize=None)
def _cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The host CPU's feature flags (`flags` of /proc/cpuinfo); empty where it cannot be
    read (not Linux, no such file)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _cpu_prefers_own_dots() -> bool:
    """Whether XLA's own dots beat YNNPACK's for few rows on this host: an x86 CPU with
    AVX2 and without AVX-512, the one kind measured faster with them; anything else (AVX-512,
    other architectures, unknown) keeps the defaults."""
    flags = _cpu_flags()
    return "avx2" in flags and "avx512f" not in flags


def decode_compiler_options(rows: int, weight_bytes: int, platform: str | None = None) -> tuple[tuple[str, str], ...]:
    """XLA compile options for a program whose decode step runs `rows` rows through
    `weight_bytes` of weights on `platform` (default: JAX's default backend), as hashable
    `(name, value)` pairs for `jax.jit(..., compiler_options=dict(...))`; `()` where the
    defaults are best.

    On a CPU with AVX2 and without AVX-512 (`_cpu_prefers_own_dots`), with at most 32 rows
    a step and at least 64 MiB of weights, the dots go to XLA's own emitter instead of
    YNNPACK (`_CPU_FEW_ROW_OPTIONS`): the same tokens, log-probs within float rounding.
    Elsewhere, or where this jaxlib refuses the option, nothing changes.
    """
    platform = platform or jax.default_backend()
    if (platform != "cpu" or rows > _CPU_FEW_ROWS or weight_bytes < _CPU_STREAMED_WEIGHT_BYTES
            or not _cpu_prefers_own_dots() or not _accepted(_CPU_FEW_ROW_OPTIONS)):
        return ()
    return _CPU_FEW_ROW_OPTIONS


def vocab_major_decode_head(platform: str | None = None) -> bool:
    """Whether a sampler on `platform` (default: JAX's default backend) computes its decode
    steps' logits vocab-major (`transformer.vocab_major_logits`, the head as `[V, D]` rows
    taken once before the loop): on a CPU, where that form of the head's dot is ~2x faster
    at 8-16 rows. Not on accelerators, where it is unmeasured and an untied head would be
    copied."""
    return (platform or jax.default_backend()) == "cpu"


@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, groups: int, window: int | None, soft_cap: float | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (length, length)
    one = sm.CausalMask(shape) if window is None else sm.LocalMask(shape, (window - 1, 0), 0)
    return sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * groups), attn_logits_soft_cap=soft_cap,
                                            interpret=interpret)


def _dividing(mesh, axes, dim: int) -> tuple[str, ...]:
    """The longest prefix of `axes` (size-1 axes dropped) whose device count divides `dim`."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes


def splash(q_BxLxNxH, k_BxKxLxH, v_BxKxLxH, key_valid_BxL, *, scale: float, window: int | None,
           soft_cap: float | None = None, interpret: bool = False, mesh=None):
    """Causal (optionally local) self-attention with the Pallas splash kernel; `[B, L, N, H]`.

    `soft_cap`: the kernel's `attn_logits_soft_cap` (scores `c·tanh(s/c)` after `scale`).

    `mesh`: an `attention.KernelMesh`; over several devices the kernel runs per device in a
    `shard_map`, batch rows split over `mesh.batch_axes` and kv heads over
    `mesh.head_axes` (each as far as they divide B and K; the rest is replicated).
    """
    local = functools.partial(_splash_local, scale=scale, window=window, soft_cap=soft_cap, interpret=interpret)
    if mesh is None or mesh.mesh.size == 1:
        return local(q_BxLxNxH, k_BxKxLxH, v_BxKxLxH, key_valid_BxL)
    rows = _dividing(mesh.mesh, mesh.batch_axes, q_BxLxNxH.shape[0])
    heads = _dividing(mesh.mesh, [a for a in mesh.head_axes if a not in rows], k_BxKxLxH.shape[1])
    r, h = rows or None, heads or None  # query heads n = k·G + g: contiguous per kv head, split alike
    q_spec, kv_spec = P(r, None, h, None), P(r, h, None, None)
    sharded = jax.shard_map(local, mesh=mesh.mesh, in_specs=(q_spec, kv_spec, kv_spec, P(r, None)),
                            out_specs=q_spec, check_vma=False)
    return sharded(q_BxLxNxH, k_BxKxLxH, v_BxKxLxH, key_valid_BxL)


def _splash_local(q_BxLxNxH, k_BxKxLxH, v_BxKxLxH, key_valid_BxL, *, scale: float, window: int | None,
                  soft_cap: float | None, interpret: bool):
    """`splash` on one device's arrays."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, l, n, h = q_BxLxNxH.shape
    kh = k_BxKxLxH.shape[1]
    g = n // kh
    lp = -(-l // _SPLASH_BLOCK) * _SPLASH_BLOCK
    pad = lambda x, axis: jnp.pad(x, [(0, lp - l) if a == axis else (0, 0) for a in range(x.ndim)])
    q_BxKxGxLxH = (q_BxLxNxH * jnp.asarray(scale, q_BxLxNxH.dtype)).reshape(b, l, kh, g, h).transpose(0, 2, 3, 1, 4)
    q_BxKxGxLxH = pad(q_BxKxGxLxH, 3)
    k, v = pad(k_BxKxLxH, 2), pad(v_BxKxLxH.astype(k_BxKxLxH.dtype), 2)
    seg_BxL = pad(key_valid_BxL.astype(jnp.int32), 1)
    kernel = _splash_kernel(lp, g, window, soft_cap, interpret)

    def one_row(q_KxGxLxH, k_KxLxH, v_KxLxH, seg_L):
        ids = sk.SegmentIds(q=seg_L, kv=seg_L)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q_KxGxLxH, k_KxLxH, v_KxLxH)

    out = jax.vmap(one_row)(q_BxKxGxLxH, k, v, seg_BxL)[:, :, :, :l]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)
    return jnp.where(key_valid_BxL[:, :, None, None], out, 0).astype(q_BxLxNxH.dtype)


def span_rotated(q_BxLxNxH, k_BxKxLxH, v_BxKxLxH, key_valid_BxL, *, scale: float, window: int | None,
                 implementation: str, fallback):
    """Self-attention through `jax.nn.dot_product_attention` on rows rotated to `[0, n)`
    spans (see the module docstring); `fallback()` computes it when a row is not one span."""
    b, l, n, h = q_BxLxNxH.shape
    valid = key_valid_BxL.astype(bool)
    idx_L = jnp.arange(l)
    count_B = jnp.sum(valid, axis=1, dtype=jnp.int32)
    start_B = jnp.where(count_B > 0, jnp.argmax(valid, axis=1), 0).astype(jnp.int32)
    last_B = jnp.max(jnp.where(valid, idx_L[None], -1), axis=1)
    one_span = jnp.all((count_B == 0) | (last_B - start_B + 1 == count_B))

    def kernel():
        fwd_BxL = (idx_L[None] + start_B[:, None]) % l
        back_BxL = (idx_L[None] - start_B[:, None]) % l
        rows = lambda x, index: jnp.take_along_axis(x, index.reshape(b, l, *(1,) * (x.ndim - 2)), axis=1)
        q = rows(q_BxLxNxH, fwd_BxL)
        k = rows(k_BxKxLxH.transpose(0, 2, 1, 3), fwd_BxL)
        v = rows(v_BxKxLxH.transpose(0, 2, 1, 3), fwd_BxL).astype(k.dtype)
        lengths = jnp.maximum(count_B, 1)  # an empty row still gets one key; it is zeroed below
        out = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
        out = rows(out, back_BxL)
        return jnp.where(valid[:, :, None, None], out, 0).astype(q_BxLxNxH.dtype)

    return lax.cond(one_span, kernel, fallback)
