"""Continuous batching (`rollout.continuous`) against the static sampler it must equal."""

import jax
import numpy as np
import pytest

from jaxrlhf.algorithms import experience
from jaxrlhf.models import ModelConfig, Transformer, _kernels, init_params
from jaxrlhf.rollout import continuous, generate, generate_continuous, sample_continuous

EOS = 2
CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
MODEL = Transformer(CFG)


def _sharpened(model, eos_gain):
    """Random params with an 8× LM head (decisive choices) whose EOS column is `eos_gain`×
    larger again: EOS is likely after some contexts and not others, so responses end at
    many different steps."""
    params = init_params(model, jax.random.key(0))
    head = params["lm_head"]["kernel"] * 8.0
    return dict(params, lm_head={"kernel": head.at[:, EOS].multiply(eos_gain)})


PARAMS = _sharpened(MODEL, 3.0)


def _prompts(b, p, seed=0):
    """`[b, p]` left-padded prompts of lengths 1..p."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (b, p))
    mask = np.arange(p)[None, :] >= (p - rng.integers(1, p + 1, b))[:, None]
    return np.where(mask, ids, 0), mask


def _assert_same(static, continuous):
    """Every `SampleOutput` field equal (ints exactly, log-probs to 1e-5)."""
    for name in static._fields:
        want, got = np.asarray(getattr(static, name)), np.asarray(getattr(continuous, name))
        assert want.shape == got.shape, name
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def _both(model, params, ids, mask, key, *, slots, **kw):
    static = generate(model, params, ids, mask, key, cpu_threads=1, **kw)
    return static, generate_continuous(model, params, ids, mask, key, slots=slots, **kw)


def test_sampled_tokens_equal_the_static_samplers_with_eos_at_every_step():
    """32 queued rows (8 prompts of lengths 1..7 × 4 samples) through 5 slots, top-k on:
    responses end at every step 1..T somewhere, so slots are refilled at every step."""
    ids, mask = _prompts(8, 7)
    t = 8
    static, cont = _both(MODEL, PARAMS, ids, mask, jax.random.key(0), slots=5, max_new_tokens=t, temperature=1.0,
                         top_k=5, eos_id=EOS, num_samples=4)
    assert set(np.asarray(static.lengths).tolist()) == set(range(1, t + 1))
    _assert_same(static, cont)


def test_a_queue_shorter_than_the_slots():
    ids, mask = _prompts(2, 6, seed=2)
    static, cont = _both(MODEL, PARAMS, ids, mask, jax.random.key(2), slots=8, max_new_tokens=7, temperature=0.7,
                         top_p=0.9, eos_id=EOS)
    _assert_same(static, cont)


def test_with_the_few_row_cpu_options_both_samplers_still_agree(monkeypatch):
    """As if the tiny model's weights streamed from memory on an AVX2-only CPU: both
    samplers compile with `decode_compiler_options` (XLA's own dots instead of YNNPACK's)
    and still agree."""
    monkeypatch.setattr(_kernels, "_CPU_STREAMED_WEIGHT_BYTES", 0)
    monkeypatch.setattr(_kernels, "_cpu_prefers_own_dots", lambda: True)  # as on an AVX2-only CPU
    seen, compiled = [], continuous._compiled
    monkeypatch.setattr(continuous, "_compiled", lambda model, options=(), **static: seen.append(options) or compiled(
        model, options, **static))
    ids, mask = _prompts(6, 5, seed=3)
    static, cont = _both(MODEL, PARAMS, ids, mask, jax.random.key(3), slots=4, max_new_tokens=6, temperature=1.0,
                         eos_id=EOS, num_samples=2)
    assert seen == [_kernels._CPU_FEW_ROW_OPTIONS]
    _assert_same(static, cont)


@pytest.mark.heavy  # a further stack
def test_greedy_on_a_sliding_window_stack_with_min_new_tokens_equals_the_static_sampler():
    """Gemma 2's local/global layers (window 3 < prompts of up to 6), soft caps, as a
    scanned stack (one cache for all layers): each slot's window is on its own cache
    slots. Greedy, EOS banned for the first 2 tokens."""
    cfg = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64, model_type="gemma2", hidden_act="gelu_pytorch_tanh",
                      norm_plus_one=True, scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=8.0,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=3,
                      layer_types=("sliding_attention", "full_attention"), scan_layers=True)
    model = Transformer(cfg)
    ids, mask = _prompts(6, 6, seed=3)
    static, cont = _both(model, _sharpened(model, 3.0), ids, mask, jax.random.key(3), slots=3, max_new_tokens=9,
                         temperature=0.0, eos_id=EOS, num_samples=2, min_new_tokens=2)
    lengths = np.asarray(static.lengths)
    assert lengths.min() >= 3 and len(set(lengths.tolist())) > 2, lengths
    _assert_same(static, cont)


@pytest.mark.parametrize("slots", [0, -2, 2.5, True, None])
def test_bad_slots_are_refused_naming_the_field(slots):
    ids, mask = _prompts(2, 4)
    for fn in (generate_continuous, sample_continuous):
        with pytest.raises(ValueError, match="slots must be a positive integer"):
            fn(MODEL, PARAMS, ids, mask, jax.random.key(0), slots=slots, max_new_tokens=4)
    if slots != 0:  # 0 is the config's "static sampler"
        with pytest.raises(ValueError, match=r"SamplingConfig\.slots=.* is impossible"):
            experience.SamplingConfig(max_new_tokens=4, slots=slots)


def test_sampling_slots_selects_continuous_batching(monkeypatch):
    calls = []
    monkeypatch.setattr(experience, "sample_continuous", lambda *a, **kw: calls.append(("continuous", kw["slots"])))
    monkeypatch.setattr(experience, "sample", lambda *a, **kw: calls.append(("static", "slots" in kw)))
    for slots in (0, 4):
        experience.sample_responses(MODEL, PARAMS, None, None, None,
                                    experience.SamplingConfig(max_new_tokens=4, slots=slots))
    assert calls == [("static", False), ("continuous", 4)]
