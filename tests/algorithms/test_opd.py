"""On-policy distillation (`algorithms.opd`): the advantage of its scoring program is
`ops.distillation_advantages` of the teacher's and the student's log-probs (plus λ × the
task's), the teacher's log-probs are `response_logprobs` through the fused head, and a
teacher folder that cannot serve the student is refused naming both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import data, ops, rewards
from jaxrlhf.algorithms import common, grpo, opd
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params, random_init, save_pretrained

pytestmark = pytest.mark.heavy  # end-to-end runs: the full suite (CI) runs them, the quick command leaves them out

V = 20
STUDENT = Transformer(ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                  num_kv_heads=2, head_dim=8, max_position_embeddings=32))
TEACHER = Transformer(ModelConfig(vocab_size=V, hidden_size=24, intermediate_size=48, num_layers=2, num_heads=2,
                                  num_kv_heads=1, head_dim=12, max_position_embeddings=32, logprobs_head="plain"))
P, T, G = 3, 4, 2


def _prompts(b=3):
    ids = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, P)), jnp.int32)
    return ids, jnp.ones((b, P), jnp.int32).at[0, 0].set(0)  # one left-padded prompt


def _evens(ids, mask, extras):
    return jnp.sum((ids % 2 == 0) & (mask > 0), axis=1).astype(jnp.float32)


@pytest.mark.parametrize("mu, task_weight", [(1, 0.0), (2, 0.5)], ids=["own-logp", "old-logp+task"])
def test_the_steps_advantage_is_distillation_advantages(mu, task_weight):
    """μ = 1 (GRPO leaves old_logp to the loss: OPD computes it) and μ = 2 (GRPO's scoring
    computes it), the latter with λ = 0.5 × the task's GRPO advantage added."""
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=T, num_samples=G, eos_id=2, pad_id=0),
                          num_iterations=mu)
    ocfg = opd.OPDConfig(task_weight=task_weight)
    s_params, t_params = init_params(STUDENT, jax.random.key(1)), init_params(TEACHER, jax.random.key(2))
    state = opd.init_state(s_params, optax.sgd(0.1), t_params)
    parts = opd.split(STUDENT, TEACHER, optax.sgd(0.1), cfg, ocfg, rewards.jax_reward(_evens, name="evens"))
    out, _ = jax.jit(parts.rollout)(state, *_prompts(), jax.random.key(3))
    batch, metrics = jax.jit(parts.score)(state, out, {}, {}, jax.random.key(4))

    mask = out.response_mask
    seq, attn = out.sequences, out.attention_mask
    t_logp, _, _ = common.response_logprobs(TEACHER, t_params, seq, attn, P)  # the plain head: [N, T, V] logits
    s_logp, _, _ = common.response_logprobs(STUDENT, s_params, seq, attn, P)
    want = ops.distillation_advantages(t_logp, s_logp, mask)
    if task_weight:
        task_batch, _ = grpo.score(state, out, {}, {}, None, model=STUDENT, cfg=cfg,
                                   reward=rewards.jax_reward(_evens, name="evens"))
        want = want + task_weight * task_batch.advantages
        assert float(jnp.max(jnp.abs(task_batch.advantages))) > 0  # the task's term is not trivially 0
    np.testing.assert_allclose(batch.advantages, want, atol=1e-5)
    assert float(jnp.max(jnp.abs(batch.advantages))) > 1e-3
    np.testing.assert_allclose(metrics["distill/reverse_kl"],
                               jnp.sum((s_logp - t_logp) * mask) / jnp.sum(mask), rtol=1e-5)
    # and the update runs on it
    new, m = jax.jit(parts.train)(state, batch, jax.random.key(5))
    assert bool(m["finite"]) and int(new.step) == 1
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), new.teacher_params, t_params))


def test_teacher_logprobs_go_through_the_fused_head_and_equal_response_logprobs(monkeypatch):
    params = init_params(TEACHER, jax.random.key(2))
    rng = np.random.default_rng(1)
    seq = jnp.asarray(rng.integers(3, V, (4, P + T)), jnp.int32)
    attn = jnp.ones_like(seq).at[1, 0].set(0).at[2, -1].set(0)
    want, _, _ = common.response_logprobs(TEACHER, params, seq, attn, P)  # plain: the [N, T, V] logits

    calls = []
    fused = common.ops.linear_logprobs
    monkeypatch.setattr(common.ops, "linear_logprobs", lambda *a, **k: calls.append(1) or fused(*a, **k))
    monkeypatch.setattr(common, "project_logits", lambda *a, **k: pytest.fail("the teacher's logits were formed"))
    got = jax.jit(lambda p, s, a: opd.teacher_logprobs(TEACHER, p, s, a, P))(params, seq, attn)
    assert calls, "the teacher's log-probs did not go through ops.linear_logprobs"
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert opd.fused_head(TEACHER).config.logprobs_head == "chunked"


def test_an_id_beyond_a_smaller_teacher_vocabulary_gets_the_floor():
    small = Transformer(ModelConfig(vocab_size=V - 2, hidden_size=16, intermediate_size=32, num_layers=1,
                                    num_heads=2, num_kv_heads=2, head_dim=8, max_position_embeddings=32))
    params = init_params(small, jax.random.key(0))
    seq = jnp.asarray([[4, 5, 6, 7, V - 1, 8, 9]], jnp.int32)
    got = opd.teacher_logprobs(small, params, seq, jnp.ones_like(seq), P)
    assert float(got[0, 1]) == opd.OUTSIDE_LOGP
    np.testing.assert_array_less(opd.OUTSIDE_LOGP, np.delete(np.asarray(got[0]), 1))


# --------------------------------------------------------------------------- the teacher's folder


def _folder(path, *, tokenizer=True, extra_token=None, vocab_size=None):
    tok = data.CharTokenizer()
    hf = tok.to_hf()
    if extra_token:
        hf.add_tokens([extra_token])
    cfg = ModelConfig(vocab_size=vocab_size or tok.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
    model, params = random_init(cfg)
    save_pretrained(model, params, path, tokenizer=hf if tokenizer else None)
    return str(path)


def test_a_teacher_folder_that_shares_the_tokenizer_passes(tmp_path):
    tok = data.CharTokenizer()
    assert opd.check_teacher(_folder(tmp_path / "t"), tok, tok.vocab_size)["vocab_size"] == tok.vocab_size
    # a larger (padded) vocabulary is fine
    assert opd.check_teacher(_folder(tmp_path / "p", vocab_size=tok.vocab_size + 8), tok, tok.vocab_size)


@pytest.mark.parametrize("case, message", [
    ("empty", r"opd.teacher_path is empty: OPD needs a teacher"),
    ("missing", r"opd.teacher_path='/no/such/teacher': no Hugging Face checkpoint folder there"),
    ("tokenizer", r"opd.teacher_path='.*': the teacher's tokenizer differs from the student's tokenizer "
                  r"'CharTokenizer' \(\d+ tokens there against \d+\)"),
    ("vocab", r"opd.teacher_path='.*': the teacher's vocab_size 8 does not hold the student's tokenizer "
              r"'CharTokenizer' \(\d+ tokens\)"),
])
def test_a_teacher_folder_that_cannot_serve_the_student_is_refused_naming_both(tmp_path, case, message):
    tok = data.CharTokenizer()
    path = {"empty": "", "missing": "/no/such/teacher",
            "tokenizer": lambda: _folder(tmp_path / "t", extra_token="@@"),
            "vocab": lambda: _folder(tmp_path / "t", tokenizer=False, vocab_size=8)}[case]
    with pytest.raises(ValueError, match=message):
        opd.check_teacher(path() if callable(path) else path, tok, tok.vocab_size)
