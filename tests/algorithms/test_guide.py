"""Guidance on failed prompts (`algorithms.guide`, `GRPOConfig.guide_coef`): which groups
fail, the NLL term against a hand-computed one, padding and micro-batch invariance, off
means today's step, bad input, and a toy task only guidance can learn."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import rewards
from jaxrlhf.algorithms import grpo, guide
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params
from jaxrlhf.runs import config_base, tasks, validation

CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=32)
MODEL = Transformer(CFG)
PARAMS = init_params(MODEL, jax.random.key(0))
P, T, R, G = 3, 4, 3, 2


def _cfg(**kw):
    return grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=T, num_samples=G, eos_id=2, pad_id=0), **kw)


def _batch(seed=0, n=8):
    """n rows in groups of G: left-padded prompts (one per group), responses, zero
    advantages (so the policy-gradient term has no gradient), and references of 1–3 tokens
    for groups 0 and 2 (failed)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 16, (n // G, P))
    plen = rng.integers(1, P + 1, n // G)
    pmask = np.arange(P)[None] >= (P - plen)[:, None]
    prompts = np.where(pmask, prompts, 0)
    resp = rng.integers(3, 16, (n, T))
    rmask = np.ones((n, T), bool)
    seq = np.concatenate([np.repeat(prompts, G, 0), resp], 1)
    attn = np.concatenate([np.repeat(pmask, G, 0), rmask], 1)
    ref = rng.integers(3, 16, (n // G, R))
    rlen = rng.integers(1, R + 1, n // G)
    refmask = np.arange(R)[None] < rlen[:, None]
    failed = np.arange(n // G) % 2 == 0
    ids, gmask = guide.guide_rows(jnp.repeat(jnp.asarray(np.where(refmask, ref, 0)), G, 0),
                                  jnp.repeat(jnp.asarray(refmask), G, 0), jnp.asarray(failed), G)
    batch = grpo.Batch(jnp.asarray(seq), jnp.asarray(attn), jnp.asarray(rmask), jnp.zeros((n, T)),
                       guide_ids=ids, guide_mask=gmask)
    return batch, prompts, pmask, ref, refmask, failed


def test_failed_groups_and_guide_rows_hand_values():
    scores = jnp.array([0.0, 0.4, 1.5, 0.2, 0.9, 0.9])  # groups of 2: best 0.4, 1.5, 0.9
    np.testing.assert_array_equal(guide.failed_groups(scores, 2, below=1.0), [True, False, True])
    ids = jnp.arange(18).reshape(6, 3)
    mask = jnp.array([[1, 1, 0]] * 6)
    out_ids, out_mask = guide.guide_rows(ids, mask, jnp.array([True, False, True]), 2)
    np.testing.assert_array_equal(out_ids, ids)
    # only each failed group's first row keeps its reference: rows 0 and 4
    np.testing.assert_array_equal(out_mask, [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])


def _hand_nll(params, prompts, pmask, ref, refmask, failed):
    """Σ over the failed prompts' valid reference tokens of −log softmax(logits)[token], over
    their count: a full forward of each prompt ⧺ reference (left-packed, no padding)."""
    total, count = 0.0, 0
    for k in np.flatnonzero(failed):
        x = [int(t) for t, m in zip(prompts[k], pmask[k]) if m] + [int(t) for t, m in zip(ref[k], refmask[k]) if m]
        x = jnp.asarray([x])
        logits = MODEL.apply({"params": params}, x, jnp.ones_like(x)).logits[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        n_prompt, n_ref = int(pmask[k].sum()), int(refmask[k].sum())
        for t in range(n_ref):
            total = total - logp[n_prompt - 1 + t, x[0, n_prompt + t]]
        count += n_ref
    return total / count


def test_guide_term_gradient_equals_a_hand_computed_nll_gradient():
    """With zero advantages the loss is `c·NLL` alone: its value and gradient equal c × the
    hand-computed NLL's (rows in whole groups: only each group's first row is run)."""
    batch, prompts, pmask, ref, refmask, failed = _batch()
    c = 0.7
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        lambda p: grpo.loss_fn(p, batch, _cfg(guide_coef=c), model=MODEL, group_size=G), has_aux=True))(PARAMS)
    hand, hand_grad = jax.jit(jax.value_and_grad(lambda p: _hand_nll(p, prompts, pmask, ref, refmask, failed)))(
        PARAMS)
    np.testing.assert_allclose(metrics["guide/nll"], hand, rtol=1e-5)
    np.testing.assert_allclose(loss, c * hand, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(hand_grad)):
        np.testing.assert_allclose(a, c * b, rtol=1e-4, atol=1e-7)


def test_guide_loss_is_invariant_to_padding_and_splits_over_microbatches():
    batch, *_ = _batch()
    args = (batch.sequences[:, :P], batch.attention_mask[:, :P], batch.guide_ids, batch.guide_mask)
    loss = jax.jit(lambda *a, total_tokens=None, g=1: guide.guide_loss(MODEL, PARAMS, *a, total_tokens=total_tokens,
                                                                       group_size=g), static_argnames="g")
    base, _ = loss(*args)
    np.testing.assert_allclose(loss(*args, g=G)[0], base, rtol=1e-6)  # each group's first row alone
    # two more pad columns left of the prompts and right of the references
    padded = (jnp.pad(args[0], ((0, 0), (2, 0))), jnp.pad(args[1], ((0, 0), (2, 0))),
              jnp.pad(args[2], ((0, 0), (0, 2))), jnp.pad(args[3], ((0, 0), (0, 2))))
    np.testing.assert_allclose(loss(*padded)[0], base, rtol=1e-5)
    # halves given the whole batch's token count add up to the whole
    total = jnp.sum(batch.guide_mask)
    halves = [loss(*(a[i:i + 4] for a in args), total_tokens=total)[0] for i in (0, 4)]
    np.testing.assert_allclose(sum(halves), base, rtol=1e-5)
    # no failed prompt: 0, not NaN
    none = loss(*args[:3], jnp.zeros_like(args[3]))
    assert float(none[0]) == 0.0 and float(none[1]) == 0.0


def test_update_with_microbatches_equals_one_batch():
    batch, *_ = _batch()
    tx = optax.sgd(0.1)
    states = []
    for k in (1, 2):
        cfg = _cfg(guide_coef=1.0, num_microbatches=k)
        state, metrics = jax.jit(lambda s, b: grpo.update(s, b, jax.random.key(0), model=MODEL, tx=tx, cfg=cfg))(
            grpo.init_state(PARAMS, tx), batch)
        states.append(state)
    for a, b in zip(jax.tree.leaves(states[0].policy.params), jax.tree.leaves(states[1].policy.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- the iteration

PROMPTS = jnp.array([[5, 6, 7], [8, 9, 10], [11, 12, 13], [3, 4, 5]])
REFS = jnp.array([[9, 14, 2, 0], [15, 3, 4, 2], [7, 2, 0, 0], [12, 12, 13, 2]])
EXTRAS = dict(reference_ids=REFS, reference_mask=REFS > 0, answer_ids=REFS, answer_mask=REFS > 0)


def _exact(ids, mask, extras):
    """1 when the response is the answer exactly (its tokens and length), else 0."""
    ref, refmask = extras["answer_ids"], extras["answer_mask"]
    same = jnp.where(refmask, ids[:, :ref.shape[1]] == ref, True) & (mask[:, :ref.shape[1]] == refmask)
    return jnp.all(same, axis=1).astype(jnp.float32)


def _run(cfg, extras, steps, lr=3e-3):
    tx = optax.adam(lr)
    it = grpo.make_iteration(MODEL, tx, cfg, rewards.jax_reward(_exact, name="exact"), time_split=False)
    state, history = grpo.init_state(PARAMS, tx), []
    for _ in range(steps):
        state, m = it(state, PROMPTS, jnp.ones_like(PROMPTS, bool), extras, jax.random.key(3))
        history.append(jax.device_get(m))
    return state, history


def test_guide_coef_0_is_exactly_todays_step():
    """guide_coef = 0 (the default) with the references in the extras changes nothing: the
    same parameters, bit for bit, as the step without them. A guide with no failed prompt
    adds a zero loss and a zero gradient."""
    no_refs = {k: v for k, v in EXTRAS.items() if k not in guide.GUIDE_KEYS}
    base, hist = _run(_cfg(), no_refs, 1)
    off, _ = _run(_cfg(guide_coef=0.0), EXTRAS, 1)
    assert "guide/nll" not in hist[0] and "guide/failed_fraction" not in hist[0]
    for a, b in zip(jax.tree.leaves(base.policy.params), jax.tree.leaves(off.policy.params)):
        np.testing.assert_array_equal(a, b)
    batch, *_ = _batch()
    batch = batch._replace(advantages=jnp.ones_like(batch.advantages))
    grads = [jax.jit(jax.grad(lambda p, b=b, c=c: grpo.loss_fn(p, b, _cfg(guide_coef=c), model=MODEL)[0]))(PARAMS)
             for b, c in ((batch, 0.0), (batch._replace(guide_mask=jnp.zeros_like(batch.guide_mask)), 1.0))]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_array_equal(a, b)


def test_guidance_teaches_what_the_policy_never_samples():
    """A random policy over 16 tokens never samples a 2–4-token reference: every group
    fails, GRPO alone has zero advantage everywhere and learns nothing; with the guide the
    references' NLL falls and the policy starts sampling them. Under dynamic sampling (the
    references follow the kept groups)."""
    _, hist = _run(_cfg(guide_coef=1.0, dynamic_sampling=True), EXTRAS, 30, lr=1e-2)
    assert float(hist[0]["guide/failed_fraction"]) == 1.0 and float(hist[0]["advantage/zero_group_fraction"]) == 1.0
    first, last = float(hist[0]["guide/nll"]), float(hist[-1]["guide/nll"])
    assert last < 0.3 * first, (first, last)
    assert float(hist[-1]["reward/mean"]) > 0.3, [float(m["reward/mean"]) for m in hist]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="guide_coef=-0.1 is impossible: it must be >= 0"):
        _cfg(guide_coef=-0.1)
    with pytest.raises(ValueError, match="guide_coef=1.0 needs each prompt's reference completion"):
        _run(_cfg(guide_coef=1.0), {k: v for k, v in EXTRAS.items() if k not in guide.GUIDE_KEYS}, 1)
    config = config_base.mlc.ConfigDict(dict(algorithm="grpo", sft=config_base.sft(), grpo=config_base.grpo(),
                                             train=config_base.train()))
    config.grpo.guide_coef = -1.0
    with pytest.raises(ValueError, match=r"grpo.guide_coef=-1.0 is impossible"):
        validation.check_values(config)


def test_a_task_without_reference_completions_names_the_field():
    task = tasks.addition(config_base.task(num_train=16, num_test=8))
    assert task.reference_keys("grpo.guide_coef=1.0") == guide.GUIDE_KEYS
    bare = dataclasses.replace(task, prompts={k: v for k, v in task.prompts.items() if k not in guide.GUIDE_KEYS})
    with pytest.raises(ValueError, match=r"grpo.guide_coef=1.0 learns the reference completions.*'addition'"):
        bare.reference_keys("grpo.guide_coef=1.0")
