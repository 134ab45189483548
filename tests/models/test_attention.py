"""Every attention implementation available here equals the dense reference, and the dense
reference equals a float64 loop over the formula in `jaxrlhf.models.attention`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import attention
from jaxrlhf.models.attention import AttentionMask

from jaxrlhf.algorithms import common
from jaxrlhf.models import load_pretrained
from jaxrlhf.rollout import generate

from .conftest import PAD, VOCAB

def _reference(q, k, v, key_valid, query_slot, scale, window, soft_cap=None):
    """float64 loops: o[b, l, n] = Σ_s softmax(cap(scale·q·k) over allowed s) v; 0 with no allowed s
    (and at a padding query, whose own slot is not a real token)."""
    b, l, n, h = q.shape
    kh = k.shape[1]
    g = n // kh
    out = np.zeros((b, l, n, h))
    for bi in range(b):
        for li in range(l):
            slot = query_slot[li]
            allowed = [s for s in range(k.shape[2]) if key_valid[bi, s] and key_valid[bi, slot] and s <= slot
                       and (window is None or s > slot - window)]
            for ni in range(n):
                if not allowed:
                    continue
                ki = ni // g
                sc = np.array([scale * q[bi, li, ni] @ k[bi, ki, s] for s in allowed])
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[bi, li, ni] = sum(pi * v[bi, ki, s] for pi, s in zip(p, allowed))
    return out


def _case(seed, *, b=3, l=20, s=None, n=6, kh=2, h=8, offset=0, fully_masked_row=True):
    """Random q/k/v and a mask with left padding, right padding and (optionally) a row
    with no valid key at all."""
    rng = np.random.default_rng(seed)
    s = l + offset if s is None else s
    q = rng.normal(size=(b, l, n, h)).astype(np.float32)
    k = rng.normal(size=(b, kh, s, h)).astype(np.float32)
    v = rng.normal(size=(b, kh, s, h)).astype(np.float32)
    key_valid = np.ones((b, s), bool)
    key_valid[0, :3] = False          # left padding
    key_valid[1, s - 5:] = False      # right padding
    key_valid[-1] = rng.random(s) < 0.6  # holes anywhere
    if fully_masked_row and b > 3:
        key_valid[2] = False
    query_slot = (offset + np.arange(l)).astype(np.int32)
    return q, k, v, key_valid, query_slot


def _run(impl, q, k, v, key_valid, query_slot, window, **kw):
    mask = AttentionMask(jnp.asarray(key_valid), jnp.asarray(query_slot))
    fn = attention.dense if impl == "dense" else functools.partial(attention.chunked, **kw)
    return fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale=0.3, window=window)


@pytest.mark.parametrize("window", [None, 5])
def test_dense_equals_float64_reference(window):
    q, k, v, key_valid, query_slot = _case(0, b=4, l=9, n=6, kh=2)
    want = _reference(q.astype(np.float64), k, v, key_valid, query_slot, 0.3, window)
    got = _run("dense", q, k, v, key_valid, query_slot, window)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def test_bfloat16_dense_scores_do_not_depend_on_the_batch():
    """bf16 q, k, v: the dense form's scores come from a dot that accumulates in float32 (as
    the chunked form's do), not from a bf16 dot cast up. XLA may drop such a bf16 → float32
    round trip in one program and keep it in another (`xla_allow_excess_precision`, on by
    default): a row then rounded differently alone and in a batch of two, so `generate`'s
    CPU row blocks drew other tokens than one program did, and their bf16 log-probs missed
    the trainer's by up to 0.1 (tests/rollout/test_parity_gate.py). Row 0 alone and in a
    batch of two now agree exactly, and stay within bf16 rounding of the float64 formula."""
    q, k, v, key_valid, query_slot = _case(3, b=2, l=7, n=4, kh=2, h=16, fully_masked_row=False)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    fn = jax.jit(lambda q, k, v, valid: attention.dense(q, k, v, AttentionMask(valid, jnp.asarray(query_slot)),
                                                        scale=0.25))
    pair = np.asarray(fn(q, k, v, jnp.asarray(key_valid)), np.float32)
    alone = np.asarray(fn(q[:1], k[:1], v[:1], jnp.asarray(key_valid[:1])), np.float32)
    np.testing.assert_array_equal(alone[0], pair[0])
    as64 = lambda x: np.asarray(x, np.float64)
    want = _reference(as64(q), as64(k), as64(v), key_valid, query_slot, 0.25, None)
    np.testing.assert_allclose(pair, want, atol=3e-2)


# (GQA group size, query/key blocks, window, offset of the queries into the keys)
CASES = [
    (1, 8, 8, None, 0),
    (3, 8, 4, None, 0),
    (8, 7, 5, None, 0),        # blocks that divide neither L nor S
    (3, 4, 8, 6, 0),            # a local window: blocks outside it are skipped
    (2, 4, 4, None, 11),        # queries at slots 11.. of 31 keys (a cache / shared prompt)
    (2, 1, 4, 3, 30),           # one query, as a decode step, with a window
]


@pytest.mark.parametrize("g, q_block, k_block, window, offset", CASES)
def test_chunked_equals_dense_values_and_gradients(g, q_block, k_block, window, offset):
    l = 1 if offset == 30 else 20
    q, k, v, key_valid, query_slot = _case(g, b=4, l=l, n=2 * g, kh=2, offset=offset)
    cot = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    mask = AttentionMask(jnp.asarray(key_valid), jnp.asarray(query_slot))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, mask, scale=0.3, window=window) * cot)

    dense = jax.jit(attention.dense, static_argnames=("scale", "window"))
    chunk = jax.jit(functools.partial(attention.chunked, q_block=q_block, k_block=k_block),
                    static_argnames=("scale", "window"))
    args = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    want = dense(*args, mask, scale=0.3, window=window)
    got = chunk(*args, mask, scale=0.3, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    g_want = jax.jit(jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2)))(*args)
    g_got = jax.jit(jax.grad(functools.partial(loss, chunk), argnums=(0, 1, 2)))(*args)
    for a, b_ in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-5)


def test_keys_in_cache_layout_and_fully_masked_rows():
    """Keys given as `[B, K, H, S]` (the KV cache) read the same; a row with no valid key
    is zero in both implementations, with zero gradient."""
    q, k, v, key_valid, query_slot = _case(5, b=4, l=12, n=4, kh=2)
    assert not key_valid[2].any()
    mask = AttentionMask(jnp.asarray(key_valid), jnp.asarray(query_slot))
    kt = jnp.asarray(k).transpose(0, 1, 3, 2)
    for fn in (attention.dense, functools.partial(attention.chunked, q_block=4, k_block=4)):
        fn = jax.jit(fn, static_argnames=("scale", "keys_transposed"))
        plain = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale=0.3)
        cached = fn(jnp.asarray(q), kt, jnp.asarray(v), mask, scale=0.3, keys_transposed=True)
        np.testing.assert_allclose(np.asarray(cached), np.asarray(plain), atol=1e-6)
        assert np.all(np.asarray(plain)[2] == 0)
        dq = jax.jit(jax.grad(lambda q: jnp.sum(fn(q, jnp.asarray(k), jnp.asarray(v), mask, scale=0.3))))(
            jnp.asarray(q))
        assert np.all(np.isfinite(np.asarray(dq))) and np.all(np.asarray(dq)[2] == 0)


def test_choose_auto_and_unknown_names():
    assert attention.choose("auto", num_queries=64, num_keys=64, num_groups=2) == "dense"
    assert attention.choose("auto", num_queries=1, num_keys=4096, num_groups=8) == "dense"  # a decode step
    assert attention.choose("auto", num_queries=4096, num_keys=4096, num_groups=1) == "chunked"
    assert attention.choose("chunked", num_queries=4, num_keys=4, num_groups=1) == "chunked"
    with pytest.raises(ValueError, match="attention='flash'"):
        attention.choose("flash", num_queries=4, num_keys=4, num_groups=1)


def test_chunked_memory_is_linear_in_length():
    """The compiled gradient's temporaries grow ~linearly with L for chunked attention and
    quadratically for the dense form (XLA's own memory plan, no weights needed)."""
    def temp(fn, l):
        shape = [jax.ShapeDtypeStruct((1, l, 4, 32), jnp.float32), jax.ShapeDtypeStruct((1, 2, l, 32), jnp.float32),
                 jax.ShapeDtypeStruct((1, 2, l, 32), jnp.float32)]
        mask = AttentionMask(jax.ShapeDtypeStruct((1, l), bool), jax.ShapeDtypeStruct((l,), jnp.int32))
        loss = lambda q, k, v, m: jnp.sum(fn(q, k, v, m, scale=0.1))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shape, mask).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunk = functools.partial(attention.chunked, q_block=256, k_block=256)
    c1, c2 = temp(chunk, 2048), temp(chunk, 4096)
    d1, d2 = temp(attention.dense, 2048), temp(attention.dense, 4096)
    assert c2 / c1 < 2.3, (c1, c2)
    assert d2 / d1 > 3.5, (d1, d2)
    assert d2 > 8 * c2, (d2, c2)


def _model_batch(seed=0, prompt_lengths=(7, 4, 1), response_lengths=(5, 2, 5), p=7, t=5):
    """Left-padded prompts followed by right-padded responses."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (len(prompt_lengths), p + t))
    mask = np.zeros_like(ids)
    for row, (n, r) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[row, p - n:p + r] = 1
    return jnp.asarray(np.where(mask, ids, PAD)), jnp.asarray(mask), p


@pytest.mark.parametrize("group_size", [1, pytest.param(3, marks=pytest.mark.heavy)])
def test_model_with_chunked_attention_equals_dense(hf_store, group_size):
    """The decoder with `attention="chunked"` gives the dense decoder's log-probs and
    gradients, on the plain path and the shared-prompt path, and samples the same tokens."""
    path = hf_store.get("qwen3")[0]
    dense_model, params = load_pretrained(path, attention="dense")
    chunk_model, _ = load_pretrained(path, attention="chunked")
    ids, mask, p = _model_batch()
    if group_size > 1:  # rows of one group share their prompt
        ids, mask = (jnp.concatenate([jnp.repeat(x[:1, :p], 3, 0), x[:, p:]], 1) for x in (ids, mask))

    def loss(model, params):
        logp, _, _ = common.response_logprobs(model, params, ids, mask, p, group_size=group_size)
        return jnp.sum(jnp.where(mask[:, p:], logp, 0.0)), logp

    (_, want), g_want = jax.jit(jax.value_and_grad(functools.partial(loss, dense_model), has_aux=True))(params)
    (_, got), g_got = jax.jit(jax.value_and_grad(functools.partial(loss, chunk_model), has_aux=True))(params)
    valid = np.asarray(mask[:, p:], bool)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_got, g_want)
    if group_size == 1:
        tokens = [generate(m, params, ids[:, :p], mask[:, :p], jax.random.key(0), max_new_tokens=4,
                           temperature=0.0).response_ids for m in (dense_model, chunk_model)]
        np.testing.assert_array_equal(np.asarray(tokens[0]), np.asarray(tokens[1]))


def _self_attention_case(seed, *, b=4, l=40, n=4, kh=2, h=16, contiguous=True):
    """Rows as this library batches them (left-padded prompt, right-padded response, one
    row with no real token); `contiguous=False` adds a row with holes."""
    q, k, v, _, query_slot = _case(seed, b=b, l=l, n=n, kh=kh, h=h)
    key_valid = np.zeros((b, l), bool)
    key_valid[0, 5:] = True
    key_valid[1, :l - 7] = True
    key_valid[3, 3:l - 4] = True
    if not contiguous:
        key_valid[3, 10:12] = False
    return q, k, v, key_valid, query_slot


def _check_against_dense(fn, case, window, atol=1e-5, reference=attention.dense):
    q, k, v, key_valid, query_slot = (jnp.asarray(x) for x in case)
    mask = AttentionMask(key_valid, query_slot)
    cot = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)
    dense = lambda q, k, v: reference(q, k, v, mask, scale=0.3, window=window)
    for f, want in ((fn, dense),):
        got_out, got_vjp = jax.vjp(f, q, k, v)
        want_out, want_vjp = jax.vjp(want, q, k, v)
        np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=atol)
        for a, b_ in zip(got_vjp(cot), want_vjp(cot)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=atol)


@pytest.mark.parametrize("window", [None, 9])
def test_splash_kernel_in_interpret_mode_equals_dense(window):
    """The TPU splash kernel's adapter (segment ids for padding, MQA kernel per kv head,
    L padded to its block), run by Pallas' interpreter on CPU."""
    from jaxrlhf.models import _kernels

    case = _self_attention_case(3)
    fn = lambda q, k, v: _kernels.splash(q, k, v, jnp.asarray(case[3]), scale=0.3, window=window, interpret=True)
    _check_against_dense(jax.jit(fn), case, window)


@pytest.mark.parametrize("contiguous, window", [(True, None), (True, 9), (False, None)])
def test_cudnn_adapter_with_the_xla_implementation_equals_dense(contiguous, window):
    """The cuDNN path's glue (rows rotated to [0, n) spans, per-row lengths, GQA, local
    window; the chunked fallback for a row with holes) with jax's XLA implementation
    standing in for cuDNN, which needs a GPU."""
    from jaxrlhf.models import _kernels

    case = _self_attention_case(4, contiguous=contiguous)
    key_valid = jnp.asarray(case[3])
    mask = AttentionMask(key_valid, jnp.asarray(case[4]))

    def fn(q, k, v):
        fallback = functools.partial(attention.chunked, q, k, v, mask, scale=0.3, window=window)
        return _kernels.span_rotated(q, k, v, key_valid, scale=0.3, window=window, implementation="xla",
                                     fallback=fallback)
    _check_against_dense(jax.jit(fn), case, window)


def test_kernels_refuse_the_wrong_backend_and_resolve_off_self_attention():
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU backend"):
        attention.choose("cudnn", num_queries=8, num_keys=8, num_groups=1, queries_are_keys=True, platform="cpu")
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.choose("cudnn", num_queries=8, num_keys=8, num_groups=1, queries_are_keys=True, platform="gpu")
    assert attention.choose("splash", num_queries=1, num_keys=64, num_groups=1, platform="tpu") == "chunked"
    big = dict(num_queries=4096, num_keys=4096, num_groups=2, queries_are_keys=True)
    assert attention.choose("auto", **big, platform="tpu") == ("splash" if jax.device_count() == 1 else "chunked")
    assert attention.choose("auto", **big, platform="gpu", dtype=jnp.bfloat16) == "cudnn"
    assert attention.choose("auto", **big, platform="gpu", dtype=jnp.float32) == "chunked"


def test_soft_cap_in_every_implementation():
    """Attention-logit soft-capping (Gemma 2): dense equals the float64 formula; chunked
    (its hand-written backward) and the splash kernel (interpreted) equal dense in values
    and gradients; cuDNN, which cannot cap, is refused and never chosen by "auto"."""
    from jaxrlhf.models import _kernels

    cap = 0.7  # small against the scores (|scale·q·k| up to ~3), so the cap bites
    q, k, v, key_valid, query_slot = _case(2, b=4, l=9, n=4, kh=2)
    want = _reference(q.astype(np.float64), k, v, key_valid, query_slot, 0.3, 4, soft_cap=cap)
    mask = AttentionMask(jnp.asarray(key_valid), jnp.asarray(query_slot))
    got = attention.dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale=0.3, window=4, soft_cap=cap)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    uncapped = _reference(q.astype(np.float64), k, v, key_valid, query_slot, 0.3, 4)
    assert np.abs(uncapped - want).max() > 1e-2

    case = _self_attention_case(5)
    capped_dense = lambda q, k, v, mask, **kw: attention.dense(q, k, v, mask, soft_cap=cap, **kw)
    key_valid = jnp.asarray(case[3])
    mask = AttentionMask(key_valid, jnp.asarray(case[4]))
    chunk = lambda q, k, v: attention.chunked(q, k, v, mask, scale=0.3, window=6, soft_cap=cap, q_block=8, k_block=4)
    _check_against_dense(jax.jit(chunk), case, 6, reference=capped_dense)
    splash = lambda q, k, v: _kernels.splash(q, k, v, key_valid, scale=0.3, window=None, soft_cap=cap,
                                             interpret=True)
    _check_against_dense(jax.jit(splash), case, None, reference=capped_dense)

    big = dict(num_queries=4096, num_keys=4096, num_groups=2, queries_are_keys=True)
    assert attention.choose("auto", **big, platform="gpu", dtype=jnp.bfloat16, soft_cap=cap) == "chunked"
    with pytest.raises(ValueError, match="attention='cudnn' cannot soft-cap .*attn_logit_softcapping"):
        attention.choose("cudnn", **big, platform="gpu", dtype=jnp.bfloat16, soft_cap=cap)
