"""The sampler against the model's own full forward pass, transformers, and statistics."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from jaxrlhf.algorithms import common
from jaxrlhf.models import ModelConfig, Transformer, _kernels, decode_compiler_options, init_params
from jaxrlhf.rollout import SampleOutput, generate, sampler, truncate_logits

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
# Random-init logits are nearly uniform; sharpen them so that greedy/top-k choices are
# well separated and EOS tests see both short and long responses.
PARAMS = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 and x.shape == (32, 37) else x, PARAMS)
MODEL_CHUNKED = Transformer(CFG.replace(logprobs_head="chunked"))  # the same params


def _prompts(rng, b, p, min_len=1):
    ids = rng.integers(3, CFG.vocab_size, (b, p))
    lens = rng.integers(min_len, p + 1, b)
    mask = np.arange(p)[None, :] >= (p - lens)[:, None]  # left padding
    return np.where(mask, ids, 0), mask


@jax.jit
def _full_logits(seq, mask):  # jitted: eager dispatch recompiled every op for each length
    return MODEL.apply({"params": PARAMS}, seq, mask).logits


@functools.partial(jax.jit, static_argnums=3)  # τ traced: one compilation for both temperatures
def _chunked_logprobs(params, seq, mask, prompt_len, temperature):
    return common.response_logprobs(MODEL_CHUNKED, params, seq, mask, prompt_len, temperature=temperature)


def test_greedy_equals_stepwise_argmax_of_full_forward():
    ids, mask = _prompts(np.random.default_rng(0), 3, 6)
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(0), max_new_tokens=7, temperature=0.0)
    seq, m = ids, mask
    for _ in range(7):
        nxt = np.asarray(jnp.argmax(_full_logits(seq, m)[:, -1], axis=-1))
        seq = np.concatenate([seq, nxt[:, None]], 1)
        m = np.concatenate([m, np.ones((3, 1), bool)], 1)
    np.testing.assert_array_equal(np.asarray(out.response_ids), seq[:, 6:])
    np.testing.assert_array_equal(np.asarray(out.sequences), seq)
    assert out.response_mask.all() and (out.lengths == 7).all()


def test_left_padded_prompts_continue_as_when_run_alone():
    ids, mask = _prompts(np.random.default_rng(1), 4, 7)
    batched = generate(MODEL, PARAMS, ids, mask, jax.random.key(0), max_new_tokens=5, temperature=0.0)
    for b in range(4):
        real = ids[b][mask[b]][None]
        alone = generate(MODEL, PARAMS, real, np.ones_like(real, bool), jax.random.key(0),
                         max_new_tokens=5, temperature=0.0)
        np.testing.assert_array_equal(np.asarray(alone.response_ids[0]), np.asarray(batched.response_ids[b]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_trainer_token_logprobs(temperature):
    ids, mask = _prompts(np.random.default_rng(2), 3, 5)
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(3), max_new_tokens=6, temperature=temperature,
                   num_samples=2)
    logits = _full_logits(out.sequences, out.attention_mask)
    # Response token t sits at P + t and is predicted by the logits at P + t - 1
    # (docs/concepts.md#shapes-masks-and-the-one-shift).
    p = ids.shape[1]
    trainer = ops.token_logprobs(logits[:, p - 1:-1], out.response_ids, temperature=temperature)
    m = np.asarray(out.response_mask)
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(trainer)[m], atol=2e-5)
    # The trainer's own path with the fused LM head (ops.linear_logprobs) agrees too.
    fused = _chunked_logprobs(PARAMS, out.sequences, out.attention_mask, p, jnp.float32(temperature))[0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(fused)[m], atol=2e-5)


@pytest.mark.parametrize("top_k, top_p, min_new, continuous", [(0, 0.7, 0, False), (5, 1.0, 0, True),
                                                                 (0, 1.0, 3, False)])
def test_behaviour_logprobs_are_those_of_the_distribution_drawn_from(top_k, top_p, min_new, continuous):
    """With top-k / top-p truncation or an EOS ban, `behaviour_logprobs` is each token's
    log-prob under the truncated, renormalised distribution (recomputed here from the full
    forward pass with `truncate_logits`), `logprobs` stays softmax(logits/τ)'s; without
    them there is none (`logprobs` are the behaviour's)."""
    from jaxrlhf.rollout.continuous import generate_continuous

    ids, mask = _prompts(np.random.default_rng(4), 3, 5)
    kw = dict(max_new_tokens=6, temperature=0.8, top_k=top_k, top_p=top_p, num_samples=2, eos_id=2,
              min_new_tokens=min_new)
    out = (generate_continuous(MODEL, PARAMS, ids, mask, jax.random.key(5), slots=4, **kw) if continuous
           else generate(MODEL, PARAMS, ids, mask, jax.random.key(5), **kw))
    p = ids.shape[1]
    logits = np.asarray(_full_logits(out.sequences, out.attention_mask), np.float32)[:, p - 1:-1] / 0.8
    m = np.asarray(out.response_mask, bool)
    n, t = m.shape
    want = np.zeros((n, t), np.float32)
    for i in range(t):
        step = jnp.asarray(logits[:, i])
        if min_new and i < min_new:
            step = step.at[:, 2].set(jnp.finfo(jnp.float32).min)
        drawn = truncate_logits(step, top_k=top_k, top_p=top_p)
        want[:, i] = np.take_along_axis(np.asarray(jax.nn.log_softmax(drawn)), np.asarray(out.response_ids)[:, i:i + 1],
                                        axis=1)[:, 0]
    got = np.asarray(out.behaviour_logprobs)
    np.testing.assert_allclose(got[m], want[m], atol=2e-5)
    assert (got[~m] == 0).all()
    assert (got[m] >= np.asarray(out.logprobs)[m] - 1e-6).all()  # renormalised over fewer tokens: never lower
    assert (got[m] > np.asarray(out.logprobs)[m] + 1e-3).any()
    np.testing.assert_array_equal(np.asarray(out.behaviour), got)
    plain = generate(MODEL, PARAMS, ids, mask, jax.random.key(5), max_new_tokens=6, temperature=0.8)
    assert plain.behaviour_logprobs is None and plain.behaviour is plain.logprobs


def test_sampling_frequencies_match_softmax_over_temperature():
    """One new token drawn 6,000 times from a fixed prompt: a chi-square test per τ."""
    ids = np.array([[5, 9, 11]])
    logits = np.asarray(_full_logits(ids, np.ones_like(ids, bool))[0, -1], np.float64)
    for tau in (1.0, 2.0):
        out = generate(MODEL, PARAMS, ids, np.ones_like(ids, bool), jax.random.key(7), max_new_tokens=1,
                       temperature=tau, num_samples=6000)
        counts = np.bincount(np.asarray(out.response_ids[:, 0]), minlength=CFG.vocab_size)
        probs = np.exp(logits / tau - np.logaddexp.reduce(logits / tau))
        # Pool rare tokens so every cell expects >= 5 draws (the chi-square approximation).
        big = probs * 6000 >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(probs[big], probs[~big].sum()) * 6000
        keep = exp > 0
        chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
        dof = keep.sum() - 1
        # 99.9% quantile of chi-square(dof) via Wilson–Hilferty; a fixed seed makes it exact.
        z = 3.09
        bound = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < bound, (tau, chi2, bound)


@pytest.mark.parametrize("top_k,top_p", [pytest.param(3, 1.0, marks=pytest.mark.heavy), (0, 0.5), (5, 0.8)])
def test_top_k_top_p_never_emit_excluded_tokens(top_k, top_p):
    ids = np.array([[5, 9, 11], [7, 7, 3]])
    mask = np.ones_like(ids, bool)
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(1), max_new_tokens=1, temperature=1.0,
                   top_k=top_k, top_p=top_p, num_samples=500)
    logits = np.asarray(_full_logits(ids, mask)[:, -1], np.float64)
    for b in range(2):
        order = np.argsort(-logits[b])
        allowed = set(order[:top_k]) if top_k else set(range(CFG.vocab_size))
        probs = np.exp(logits[b] - np.logaddexp.reduce(logits[b]))
        if top_p < 1.0:
            cum_before = np.cumsum(probs[order]) - probs[order]
            allowed &= set(order[cum_before < top_p])
        drawn = set(np.asarray(out.response_ids[b * 500:(b + 1) * 500, 0]).tolist())
        assert drawn <= allowed, (drawn - allowed)
        assert len(drawn) >= min(2, len(allowed))


def test_truncate_logits_keeps_the_token_that_crosses_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = np.isfinite(np.asarray(truncate_logits(logits, top_p=0.6))) & (np.asarray(truncate_logits(logits, top_p=0.6)) > -1e30)
    # mass before each token: 0, .5, .8, .95 -> tokens 0 and 1 (.5 < .6) are kept.
    np.testing.assert_array_equal(kept[0], [True, True, False, False])


def test_eos_ends_the_mask_and_pads_after():
    ids, mask = _prompts(np.random.default_rng(4), 8, 4)
    eos = 4
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(11), max_new_tokens=12, temperature=3.0,
                   eos_id=eos, pad_id=0)
    toks, m, lp = map(np.asarray, (out.response_ids, out.response_mask, out.logprobs))
    saw_short = False
    for b in range(8):
        hits = np.flatnonzero(toks[b] == eos)
        length = hits[0] + 1 if hits.size else 12
        saw_short |= length < 12
        assert out.lengths[b] == length
        np.testing.assert_array_equal(m[b], np.arange(12) < length)
        assert (toks[b, length:] == 0).all() and (lp[b, length:] == 0).all()
    assert saw_short, "no sequence hit EOS: the test does not exercise stopping"
    np.testing.assert_array_equal(np.asarray(out.attention_mask), np.concatenate([mask, m], 1))


@pytest.mark.parametrize("temperature", [pytest.param(3.0, marks=pytest.mark.heavy), 0.0])
def test_min_new_tokens_never_draws_eos_before_it(temperature):
    """The run above with min_new_tokens=5: no EOS among the first 5 tokens, EOS still ends
    responses after them, the log-probs stay the model's (what the trainer recomputes)."""
    ids, mask = _prompts(np.random.default_rng(4), 8, 4)
    k, kw = 5, dict(max_new_tokens=12, temperature=temperature, pad_id=0)
    # EOS := the token drawn most often among the first k: without the rule, rows stop early.
    early = np.asarray(generate(MODEL, PARAMS, ids, mask, jax.random.key(11), **kw).response_ids)[:, :k]
    eos = int(np.bincount(early.ravel(), minlength=CFG.vocab_size)[1:].argmax() + 1)
    kw["eos_id"] = eos
    free = generate(MODEL, PARAMS, ids, mask, jax.random.key(11), **kw)
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(11), min_new_tokens=k, **kw)
    assert (np.asarray(free.lengths) < k).any(), "EOS never drawn early: the test means nothing"
    toks, m = np.asarray(out.response_ids), np.asarray(out.response_mask)
    assert not (toks[:, :k] == eos).any() and (np.asarray(out.lengths) >= k).all()
    for b in range(8):  # still stops at the first EOS after the k-th token
        hits = np.flatnonzero(toks[b] == eos)
        assert out.lengths[b] == (hits[0] + 1 if hits.size else 12)
    seq, attn = out.sequences, out.attention_mask
    want = _chunked_logprobs(PARAMS, seq, attn, ids.shape[1], jnp.float32(temperature or 1.0))[0]
    np.testing.assert_allclose(np.where(m, out.logprobs, 0), np.where(m, want, 0), atol=2e-5)


def test_num_samples_share_the_prompt_and_are_grouped():
    ids, mask = _prompts(np.random.default_rng(5), 2, 5)
    out = generate(MODEL, PARAMS, ids, mask, jax.random.key(2), max_new_tokens=4, num_samples=3)
    assert out.response_ids.shape == (6, 4)
    np.testing.assert_array_equal(np.asarray(out.prompt_ids), np.repeat(ids, 3, axis=0))
    greedy = generate(MODEL, PARAMS, ids, mask, jax.random.key(2), max_new_tokens=4, temperature=0.0,
                      num_samples=3)
    single = generate(MODEL, PARAMS, ids, mask, jax.random.key(2), max_new_tokens=4, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(greedy.response_ids), np.repeat(np.asarray(single.response_ids), 3, 0))


def test_deterministic_for_a_given_key():
    ids, mask = _prompts(np.random.default_rng(6), 2, 5)
    a = generate(MODEL, PARAMS, ids, mask, jax.random.key(9), max_new_tokens=8, temperature=1.5)
    b = generate(MODEL, PARAMS, ids, mask, jax.random.key(9), max_new_tokens=8, temperature=1.5)
    c = generate(MODEL, PARAMS, ids, mask, jax.random.key(10), max_new_tokens=8, temperature=1.5)
    np.testing.assert_array_equal(np.asarray(a.response_ids), np.asarray(b.response_ids))
    assert (np.asarray(a.response_ids) != np.asarray(c.response_ids)).any()


def _draw_f64(logits_V, g_M, blk=256):
    """The float64 reference of the two-level Gumbel-max: the block of the largest
    log-mass + g, then the token of the largest logit + g inside it."""
    x = np.asarray(logits_V, np.float64)
    v = x.size
    nb = -(-v // blk) if v > blk else 1
    blk = min(blk, v)
    x = np.concatenate([x, np.full(nb * blk - v, -np.inf)]).reshape(nb, blk)
    with np.errstate(divide="ignore"):
        j = int(np.argmax(np.log(np.exp(x - x.max()).sum(axis=1)) + g_M[:nb]))
    return j * blk + int(np.argmax(x[j] + g_M[nb:nb + blk]))


def test_each_step_draws_the_two_level_gumbel_max_of_its_rows_noise():
    # Row r at step t draws from softmax(logits/τ) with the Gumbel noise of fold_in(fold_in(key, r), t).
    ids, mask = _prompts(np.random.default_rng(12), 3, 5, min_len=5)
    key, tau, v = jax.random.key(4), 1.7, CFG.vocab_size
    out = generate(MODEL, PARAMS, ids, mask, key, max_new_tokens=4, temperature=tau, cpu_threads=1)
    seq = np.asarray(out.sequences)
    logits = np.asarray(_full_logits(seq, np.ones_like(seq, bool))[:, ids.shape[1] - 1:-1], np.float64)
    m = sum(sampler._draw_blocks(v))
    g = lambda r, t: np.asarray(jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, r), t), (m,)), np.float64)
    want = [[_draw_f64(logits[r, t] / tau, g(r, t)) for t in range(4)] for r in range(3)]
    np.testing.assert_array_equal(np.asarray(out.response_ids), np.asarray(want))


@pytest.mark.parametrize("v", [7, 256, 1000, 4096])
def test_draw_equals_the_float64_reference_and_skips_zero_mass(v):
    rng = np.random.default_rng(v)
    logits = rng.normal(0, 3, (64, v)).astype(np.float32)
    logits[:, rng.random(v) < 0.5] = np.finfo(np.float32).min  # truncated: never drawn
    logits[:, rng.integers(v)] = 2.0  # at least one token left in every row
    logits[:2, :] = np.finfo(np.float32).min  # rows with a single token left: it is drawn
    logits[0, v - 1] = logits[1, 0] = 0.0
    g = jax.random.gumbel(jax.random.key(v), (64, sum(sampler._draw_blocks(v))))
    got = np.asarray(jax.jit(sampler._draw)(jnp.asarray(logits), g))
    want = [_draw_f64(logits[i], np.asarray(g[i], np.float64)) for i in range(64)]
    assert (logits[np.arange(64), got] > np.finfo(np.float32).min).all()
    assert got[0] == v - 1 and got[1] == 0
    np.testing.assert_array_equal(got, np.asarray(want))


def test_draw_frequencies_are_the_softmax():
    v, draws = 700, 50_000  # three blocks, the last one partial
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 1.5, (v,)), jnp.float32)
    g = jax.random.gumbel(jax.random.key(0), (draws, sum(sampler._draw_blocks(v))))
    tokens = jax.jit(sampler._draw)(jnp.broadcast_to(logits, (draws, v)), g)
    freq = np.bincount(np.asarray(tokens), minlength=v) / draws
    x = np.asarray(logits, np.float64)
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(p * (1 - p) / draws).max())


def test_a_draw_is_stable_under_the_float_rounding_of_its_logits():
    """Two programs that compute the same logits with other dot kernels (static and
    continuous batching, row blocks) differ by float rounding; at a real vocabulary with
    near-flat logits their draws must still agree. Nudged by up to 1e-6, 4,000 draws at V =
    49,152: an inverse CDF of one uniform per row moved 5 of them (~0.1 %; 4 of 32 rows of a
    real-shaped continuous batch differed from the static one); a Gumbel-max moves a draw
    only at a near tie of two perturbed scores."""
    v, rows = 49_152, 500
    draw = jax.jit(sampler._draw)
    moved = 0
    for c in range(8):
        rng = np.random.default_rng(c)
        logits = 0.1 * rng.standard_normal((rows, v), dtype=np.float32)
        nudged = logits + rng.uniform(-1e-6, 1e-6, (rows, v)).astype(np.float32)
        g = jax.random.gumbel(jax.random.key(c), (rows, sum(sampler._draw_blocks(v))))
        moved += int((np.asarray(draw(logits, g)) != np.asarray(draw(nudged, g))).sum())
    assert moved == 0, moved


def test_a_rows_sample_does_not_depend_on_the_other_rows():
    ids, mask = _prompts(np.random.default_rng(14), 4, 5)
    other_ids, other_mask = _prompts(np.random.default_rng(15), 4, 5)
    ids2, mask2 = ids.copy(), mask.copy()
    ids2[2:], mask2[2:] = other_ids[2:], other_mask[2:]
    kw = dict(max_new_tokens=6, temperature=1.2, cpu_threads=1)
    a = generate(MODEL, PARAMS, ids, mask, jax.random.key(8), **kw)
    b = generate(MODEL, PARAMS, ids2, mask2, jax.random.key(8), **kw)
    np.testing.assert_array_equal(np.asarray(a.response_ids[:2]), np.asarray(b.response_ids[:2]))
    assert (np.asarray(a.response_ids[2:]) != np.asarray(b.response_ids[2:])).any()


@pytest.mark.parametrize("threads,kw", [
    (2, dict(temperature=1.0, num_samples=3)),
    pytest.param(4, dict(temperature=2.5, top_k=9, top_p=0.9, eos_id="early", num_samples=2), marks=pytest.mark.heavy),
])
def test_row_blocks_on_cpu_threads_sample_what_one_program_samples(threads, kw):
    ids, mask = _prompts(np.random.default_rng(16), 4, 6)
    if kw.get("eos_id") == "early":  # a token row 0 draws third without EOS: with it as EOS, row 0 stops there
        free = generate(MODEL, PARAMS, ids, mask, jax.random.key(6), max_new_tokens=9, cpu_threads=1,
                        **dict(kw, eos_id=None))
        kw = dict(kw, eos_id=int(free.response_ids[0, 2]))
    one = generate(MODEL, PARAMS, ids, mask, jax.random.key(6), max_new_tokens=9, cpu_threads=1, **kw)
    assert sampler.cpu_row_blocks(4, PARAMS, ids, cpu_threads=threads) == threads
    blocks = generate(MODEL, PARAMS, ids, mask, jax.random.key(6), max_new_tokens=9, cpu_threads=threads, **kw)
    for name, x, y in zip(SampleOutput._fields, one, blocks):
        if x is None:  # behaviour_logprobs without truncation
            assert y is None, name
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if name in ("logprobs", "behaviour_logprobs"):  # blocks of fewer rows may round the matmuls differently
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)
    if "eos_id" in kw:
        assert (np.asarray(one.lengths) < 9).any(), "no row hit EOS: the test does not exercise stopping"


def test_cpu_row_blocks_divide_the_batch_and_stay_whole_when_traced():
    ids = np.zeros((6, 3), np.int32)
    assert sampler.cpu_row_blocks(6, PARAMS, ids, cpu_threads=4) == 3  # largest divisor <= 4
    assert sampler.cpu_row_blocks(7, PARAMS, ids, cpu_threads=4) == 1
    assert sampler.cpu_row_blocks(6, PARAMS, ids, cpu_threads=1) == 1
    assert sampler.cpu_row_blocks(1, PARAMS, ids, cpu_threads=8) == 1
    seen = []  # under a trace the blocks could not be waited for: one program
    jax.jit(lambda p: seen.append(sampler.cpu_row_blocks(6, p, cpu_threads=4)) or 0)(PARAMS)
    assert seen == [1]
    with pytest.raises(ValueError, match="cpu_threads"):
        sampler.cpu_row_blocks(6, PARAMS, cpu_threads=0)


def test_the_default_splits_only_where_blocks_keep_one_row_per_12_mib_of_weights(monkeypatch):
    monkeypatch.setattr(sampler, "_usable_cores", lambda: 2)
    mib = 2**20
    small, large = 12 * mib, 621 * mib  # the workload model; SmolLM2-135M in float32
    assert sampler.cpu_row_blocks(16, PARAMS, weight_bytes=small) == 2
    assert sampler.cpu_row_blocks(16, PARAMS, weight_bytes=large) == 1  # 8 rows a block: slower, measured
    assert sampler.cpu_row_blocks(4, PARAMS, rows_per_prompt=4, weight_bytes=large) == 1
    assert sampler.cpu_row_blocks(64, PARAMS, weight_bytes=324 * mib) == 2  # 32 rows a block: faster
    assert sampler.cpu_row_blocks(64, PARAMS, weight_bytes=large) == 1
    assert sampler.cpu_row_blocks(16, PARAMS, cpu_threads=2, weight_bytes=large) == 2  # an explicit choice stands


def test_decode_compiler_options_only_for_few_rows_of_streamed_weights_on_an_avx2_cpu(monkeypatch):
    mib = 2**20
    few_rows = _kernels._CPU_FEW_ROW_OPTIONS
    monkeypatch.setattr(_kernels, "_cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma"}))
    assert decode_compiler_options(8, 513 * mib, "cpu") == few_rows  # SmolLM2-135M in float32
    assert decode_compiler_options(32, 513 * mib, "cpu") == few_rows
    assert decode_compiler_options(33, 513 * mib, "cpu") == ()  # YNNPACK's dots win from 64 rows
    assert decode_compiler_options(8, 12 * mib, "cpu") == ()  # weights in cache: YNNPACK's win
    assert decode_compiler_options(8, 513 * mib, "gpu") == ()
    assert decode_compiler_options(8, 513 * mib, "tpu") == ()
    assert _kernels._accepted(few_rows)  # this jaxlib knows the flag (else the rule is a no-op)
    assert not _kernels._accepted((("xla_cpu_no_such_option", "1"),))
    for flags in ({"avx2", "avx512f"}, {"asimd", "sve"}, set()):  # AVX-512 (YNNPACK's win), Arm, unknown
        monkeypatch.setattr(_kernels, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert decode_compiler_options(8, 513 * mib, "cpu") == (), flags
    monkeypatch.setattr(_kernels, "_cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(_kernels, "_CPU_FEW_ROW_OPTIONS", (("xla_cpu_no_such_option", "1"),))
    assert decode_compiler_options(8, 513 * mib, "cpu") == ()  # a jaxlib that refuses it: defaults


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n")
    assert _kernels._cpu_flags.__wrapped__(str(info)) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    assert _kernels._cpu_flags.__wrapped__(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, num_samples=2),
    dict(temperature=0.0, eos_id=4),
])
def test_few_row_cpu_options_sample_the_same_tokens(monkeypatch, kw):
    ids, mask = _prompts(np.random.default_rng(21), 4, 6)
    run = lambda: generate(MODEL, PARAMS, ids, mask, jax.random.key(8), max_new_tokens=9, cpu_threads=1, **kw)
    default = run()
    monkeypatch.setattr(_kernels, "_CPU_STREAMED_WEIGHT_BYTES", 0)  # the tiny model as if its weights streamed
    monkeypatch.setattr(_kernels, "_cpu_prefers_own_dots", lambda: True)  # as on an AVX2-only CPU
    seen, compiled = [], sampler._compiled
    monkeypatch.setattr(sampler, "_compiled", lambda model, options=(), **static: seen.append(options) or compiled(
        model, options, **static))
    with_options = run()
    assert seen == [_kernels._CPU_FEW_ROW_OPTIONS]
    for name, x, y in zip(SampleOutput._fields, default, with_options):
        if x is None:  # behaviour_logprobs without truncation
            assert y is None, name
            continue
        if name in ("logprobs", "behaviour_logprobs"):  # the dots' summation order differs
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=60), "exceeds"),
    (dict(max_new_tokens=4, max_len=6), "max_len"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, top_k=-1), "top_k"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=4, num_samples=0), "num_samples"),
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
])
def test_bad_arguments_raise_clear_errors(kwargs, msg):
    ids, mask = _prompts(np.random.default_rng(7), 2, 5)
    with pytest.raises(ValueError, match=msg):
        generate(MODEL, PARAMS, ids, mask, jax.random.key(0), **kwargs)


def test_mismatched_mask_shape_raises():
    ids, mask = _prompts(np.random.default_rng(7), 2, 5)
    with pytest.raises(ValueError, match="prompt_mask"):
        generate(MODEL, PARAMS, ids, mask[:, :4], jax.random.key(0), max_new_tokens=2)


def test_greedy_equals_transformers_generate(tmp_path):
    """Token-exact against transformers' greedy `generate` on a tiny random checkpoint."""
    import torch
    import transformers

    from jaxrlhf.models import load_pretrained

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # sharpen the random logits so near-ties cannot flip the argmax
        hf.lm_head.weight.mul_(20.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, params = load_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(3, 97, (3, 7))
    ours = generate(model, params, ids, np.ones_like(ids, bool), jax.random.key(0), max_new_tokens=10,
                    temperature=0.0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                             do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(ours.response_ids), theirs[:, 7:].numpy())


def test_decode_windows_split_long_decodes_into_up_to_four_segments():
    assert sampler.decode_windows(1) == (1,)
    assert sampler.decode_windows(127) == (127,)
    assert sampler.decode_windows(128) == (64, 128)
    assert sampler.decode_windows(130) == (65, 130)
    assert sampler.decode_windows(256) == (64, 128, 192, 256)
    assert sampler.decode_windows(1000) == (250, 500, 750, 1000)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, num_samples=2),  # every row runs through both segments
    dict(temperature=0.0, eos_id=4),
    dict(temperature=1.0, top_k=5, eos_id=4, min_new_tokens=70),  # EOS inside the second segment
])
def test_cache_windows_and_the_vocab_major_head_never_change_a_sample(monkeypatch, kw):
    model = Transformer(CFG.replace(max_position_embeddings=256))  # the same params, room for 130 tokens
    ids, mask = _prompts(np.random.default_rng(17), 3, 6)
    run = lambda: jax.jit(functools.partial(sampler.sample, model, max_new_tokens=130, **kw))(
        PARAMS, ids, mask, jax.random.key(4))
    assert sampler.decode_windows(130) == (65, 130) and _kernels.vocab_major_decode_head("cpu")
    windowed = run()
    monkeypatch.setattr(sampler, "_MAX_WINDOWS", 1)
    monkeypatch.setattr(sampler, "vocab_major_decode_head", lambda: False)
    whole = run()  # one cache of P + T slots, logits from the model's own head
    assert int(np.asarray(whole.lengths).max()) > 65  # the second segment ran
    for name, x, y in zip(SampleOutput._fields, whole, windowed):
        if x is None:  # behaviour_logprobs without truncation
            assert y is None, name
            continue
        if name in ("logprobs", "behaviour_logprobs"):  # the head's dot sums in another order
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)


def test_the_decode_loops_ops_are_named_by_their_part():
    """`benchmarks/profile_decode.py` sums a profile by these names in the ops' `op_name`."""
    ids, mask = _prompts(np.random.default_rng(18), 2, 5)
    fn = jax.jit(functools.partial(sampler.sample, MODEL, max_new_tokens=3))
    hlo = fn.lower(PARAMS, ids, mask, jax.random.key(0)).compile().as_text()
    in_loop = [n for n in re.findall(r'op_name="([^"]*)"', hlo) if "while/body" in n]
    for part in ("lm_head", "/pick/", "/q_proj/", "/k_proj/", "/v_proj/", "/o_proj/", "/gate_proj/", "/up_proj/",
                 "/down_proj/", "self_attn/"):
        assert any(part in n for n in in_loop), part
