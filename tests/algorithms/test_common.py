"""Shared algorithm pieces: the response shift and accumulation invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from jaxrlhf.algorithms import common
from jaxrlhf.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
MODEL = Transformer(CFG, head="lm_value")
PARAMS = init_params(MODEL, jax.random.key(0))


def _batch(rng, b=8, p=4, t=5):
    seq = rng.integers(3, 29, (b, p + t))
    plen = rng.integers(1, p + 1, b)
    rlen = rng.integers(0, t + 1, b)
    pmask = np.arange(p)[None] >= (p - plen)[:, None]
    rmask = np.arange(t)[None] < rlen[:, None]
    return jnp.asarray(seq), jnp.asarray(np.concatenate([pmask, rmask], 1)), jnp.asarray(rmask)


def test_response_logprobs_read_the_logits_one_position_earlier():
    seq, attn, _ = _batch(np.random.default_rng(0))
    logp, ent, values = common.response_logprobs(MODEL, PARAMS, seq, attn, 4, temperature=0.7, with_entropy=True)
    out = MODEL.apply({"params": PARAMS}, seq, attn)
    full = np.asarray(jax.nn.log_softmax(out.logits / 0.7, axis=-1), np.float64)
    for b in range(seq.shape[0]):
        for t in range(5):
            np.testing.assert_allclose(logp[b, t], full[b, 4 + t - 1, int(seq[b, 4 + t])], atol=1e-5)
            np.testing.assert_allclose(values[b, t], out.values[b, 4 + t - 1], atol=1e-6)
    np.testing.assert_allclose(ent, ops.entropy(out.logits[:, 3:-1], temperature=0.7), atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_accumulation_4x4_equals_1x16_for_every_aggregation(mode):
    rng = np.random.default_rng(1)
    seq, attn, rmask = _batch(rng, b=16)
    batch = dict(seq=seq, attn=attn, mask=rmask, adv=jnp.asarray(rng.standard_normal((16, 5)), jnp.float32),
                 old=jnp.asarray(rng.standard_normal((16, 5)) * 0.1 - 3.0, jnp.float32))
    total_tokens = jnp.sum(rmask, dtype=jnp.float32)

    def loss_fn(params, mb, _):
        logp, _, _ = common.response_logprobs(MODEL, params, mb["seq"], mb["attn"], 4)
        loss, metrics = ops.policy_loss(logp, mb["old"], mb["adv"], mb["mask"], agg=mode, norm_len=5)
        scale = common.accumulation_scale(mb["mask"], mode=mode, total_tokens=total_tokens, total_seqs=16)
        return loss * scale, metrics

    accumulate = jax.jit(common.accumulate_gradients, static_argnums=(0,), static_argnames="num_microbatches")
    full_loss, full_m, full_grads = accumulate(loss_fn, PARAMS, batch, num_microbatches=1)
    acc_loss, acc_m, acc_grads = accumulate(loss_fn, PARAMS, batch, num_microbatches=4)
    np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-5)
    # Extremes stay extremes: the worst ratio of any micro-batch is the batch's worst ratio.
    np.testing.assert_allclose([acc_m["ratio_max"], acc_m["ratio_min"]], [full_m["ratio_max"], full_m["ratio_min"]],
                               rtol=1e-6)
    assert float(full_m["ratio_max"]) > float(full_m["ratio_min"]) + 1e-3
    for g1, g4 in zip(jax.tree.leaves(full_grads), jax.tree.leaves(acc_grads)):
        np.testing.assert_allclose(g4, g1, rtol=2e-4, atol=1e-7)
    # The plain mean of micro-batch token-means weighs tokens unequally: the weighting matters.
    if mode == "token-mean":
        part = jax.jit(lambda s, a, old, adv, m: ops.policy_loss(
            common.response_logprobs(MODEL, PARAMS, s, a, 4)[0], old, adv, m, agg=mode)[0])
        naive = jnp.mean(jnp.stack([part(seq[i:i + 4], attn[i:i + 4], batch["old"][i:i + 4], batch["adv"][i:i + 4],
                                         rmask[i:i + 4]) for i in range(0, 16, 4)]))
        assert not np.isclose(naive, full_loss, rtol=1e-4)


def test_schedule_and_optimizer():
    tx, sched = common.make_optimizer(common.OptimConfig(lr=1.0, schedule="linear", warmup_steps=2, total_steps=6))
    np.testing.assert_allclose([sched(i) for i in range(7)], [0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="schedule"):
        common.make_optimizer(common.OptimConfig(schedule="exp"))


def test_tree_finite():
    assert common.tree_finite({"a": jnp.ones(3)})
    assert not common.tree_finite({"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2, jnp.int32)})


def _grouped_batch(rng, prompts=3, g=4, p=4, t=5):
    """`prompts` left-padded prompts, each repeated for its `g` right-padded responses."""
    seq, attn, rmask = _batch(rng, b=prompts * g, p=p, t=t)
    seq = seq.at[:, :p].set(jnp.repeat(seq[::g, :p], g, axis=0))
    attn = attn.at[:, :p].set(jnp.repeat(attn[::g, :p], g, axis=0))
    return seq, attn, rmask


def test_shared_prompt_forward_equals_the_full_forward():
    """Each group's prompt run once: same log-probs, entropy, values and gradients, also
    through rematerialised layers (the plain path is checked in test_grpo and test_dpo)."""
    model = Transformer(CFG.replace(remat=True), head="lm_value")
    seq, attn, rmask = _grouped_batch(np.random.default_rng(3))

    def loss(params, group_size):
        logp, ent, values = common.response_logprobs(model, params, seq, attn, 4, temperature=0.7,
                                                     with_entropy=True, group_size=group_size)
        outs = [jnp.where(rmask, x, 0.0) for x in (logp, ent, values)]
        return sum(jnp.sum(o * w) for o, w in zip(outs, (1.0, 0.3, 0.1))), outs

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l1, full), g1 = grad_fn(PARAMS, 1)
    (l4, shared), g4 = grad_fn(PARAMS, 4)
    for a, b in zip(full, shared):
        np.testing.assert_allclose(b, a, atol=2e-6)
    np.testing.assert_allclose(l4, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="do not split into groups of group_size=5"):
        common.response_logprobs(model, PARAMS, seq, attn, 4, group_size=5)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_equals_plain_head(tied):
    """`logprobs_head="chunked"` (ops.linear_logprobs on `lm_head_weight`) gives the plain
    path's log-probs, entropies, greedy tokens and parameter gradients, tied or untied."""
    cfg = CFG.replace(tie_word_embeddings=tied)
    params = init_params(Transformer(cfg), jax.random.key(1))
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((3, 7, CFG.hidden_size)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 7)))

    def loss(params, head):
        out = common.head_logprobs(cfg.replace(logprobs_head=head), params, hidden, targets, temperature=0.7,
                                   with_entropy=True, with_argmax=True)
        return jnp.sum(out.logp * jnp.arange(7.0)) + jnp.sum(out.entropy), out

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, plain), g_plain = grad_fn(params, "plain")
    (_, chunked), g_chunked = grad_fn(params, "chunked")
    np.testing.assert_allclose(chunked.logp, plain.logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunked.entropy, plain.entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked.argmax, plain.argmax)
    head = ("embed_tokens", "embedding") if tied else ("lm_head", "kernel")
    assert np.any(g_plain[head[0]][head[1]] != 0)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_chunked)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))


def test_auto_head_picks_by_size():
    # B·T·V against CHUNKED_HEAD_FROM = 2**24: V = 151,936 at B·T = 111 is 16.86M ≥ 2**24 =
    # 16.78M, at B·T = 110 below; the built-in task (V ≈ 20, B·T in the thousands) stays plain.
    big = CFG.replace(vocab_size=151_936)
    assert common.uses_chunked_head(big, 3, 37) and not common.uses_chunked_head(big, 1, 110)
    assert not common.uses_chunked_head(CFG.replace(vocab_size=20), 256, 1024)
    assert common.uses_chunked_head(CFG.replace(logprobs_head="chunked"), 1, 1)
    assert not common.uses_chunked_head(big.replace(logprobs_head="plain"), 64, 4096)
    with pytest.raises(ValueError, match="logprobs_head='fused'; expected one of"):
        CFG.replace(logprobs_head="fused")


def test_minibatch_scan_visits_every_row_once_per_pass_and_summarizes():
    batch = {"x": jnp.arange(8.0)}

    def step(total, mb):
        s = jnp.sum(mb["x"])
        return total + s, {"sum": s, "ratio_max": jnp.max(mb["x"]), "finite": s < 20}

    total, stacked = jax.jit(lambda b, k: common.minibatch_scan(step, 0.0, b, k, passes=3, minibatches=2))(
        batch, jax.random.key(0))
    assert stacked["sum"].shape == (6,) and float(total) == 3 * 28.0
    np.testing.assert_allclose(stacked["sum"].reshape(3, 2).sum(1), 28.0)  # each pass: every row once
    whole = common.minibatch_scan(step, 0.0, batch, None, passes=2, minibatches=1, shuffle=False)[1]
    np.testing.assert_allclose(whole["sum"], [28.0, 28.0])
    m = common.summarize_steps(stacked, skipped="skipped", first={"first/ratio_max": "ratio_max"})
    assert float(m["sum"]) == 14.0 and float(m["ratio_max"]) == 7.0 and m["first/ratio_max"] == stacked["ratio_max"][0]
    assert bool(m["finite"]) == bool(jnp.all(stacked["finite"])) and int(m["skipped"]) == int(jnp.sum(~stacked["finite"]))


def test_jit_keeping_frozen_donates_only_the_trained_fields():
    import flax

    @flax.struct.dataclass
    class State:
        w: jax.Array
        frozen: jax.Array

    def fn(state, x):
        return state.replace(w=state.w + state.frozen * x), x

    call = common.jit_keeping_frozen(fn, ("frozen",), donate=True)
    state = State(jnp.ones(3), jnp.full(3, 2.0))
    new, x = call(state, 3.0)
    np.testing.assert_allclose(new.w, 7.0)
    assert new.frozen is state.frozen and not state.frozen.is_deleted()
