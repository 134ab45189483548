"""LoRA for PPO's critic and the reward model: one frozen base, small trained parts.

The critic and reward model train their adapters and score head only (`lora.trainable`
with `lora.HEADS`), start exactly at the base's trunk, and, as parts alone
(`lora.is_part`), run on the actor's base arrays (`lora.on_base`); a PPO iteration on
such a state computes its reference log-probs from the actor's base (equal to a separate
copy of the base model's), trains the actor's and critic's adapters and nothing else, and
a LoRA reward model's merged export loads in transformers with the adapter forward's scores.
Tiny shapes; every function is compiled once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.algorithms import common, ppo, reward_model
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params, lora
from jaxrlhf.runs.experiment import _export_merged

V, P, T = 24, 4, 6
CFG = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, max_position_embeddings=32, pad_token_id=0)
LORA = CFG.replace(lora=lora.LoraConfig(rank=4))
ACTOR, BASE_ACTOR = Transformer(LORA), Transformer(CFG)
SCORE, BASE_SCORE = Transformer(LORA, head="score"), Transformer(CFG, head="score")


def _sequences(n=4, seed=0):
    ids = np.random.default_rng(seed).integers(3, V, (n, P + T))
    return jnp.asarray(ids, jnp.int32), jnp.ones((n, P + T), bool)


def _with_moved_b(params, seed):
    """`params` with every `lora_b` drawn at random (a trained adapter, not the B = 0 start)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype)
        if path[-1].key == "lora_b" else x, params)


def _b_leaves(tree) -> list:
    """Every `lora_b` of `tree`, in path order."""
    return [x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if path[-1].key == "lora_b"]


@pytest.fixture(scope="module")
def roles():
    """The base, the actor (base + adapters), and a reward model with its own adapters and
    score head on the same trunk (the arrays shared, as `copy=False` gives)."""
    base = init_params(BASE_ACTOR, jax.random.key(0))
    actor = lora.add_adapters(ACTOR, base, jax.random.key(1))
    _, rm = reward_model.init_from_policy(ACTOR, base, seed=2, copy=False)
    return base, actor, lora.add_adapters(SCORE, rm, jax.random.key(3))


def test_critic_and_reward_model_start_at_the_base_and_train_only_adapters_and_head(roles):
    base, actor, rm = roles
    seq, attn = _sequences()
    score = jax.jit(reward_model.score, static_argnums=0)
    np.testing.assert_array_equal(score(SCORE, rm, seq, attn), score(BASE_SCORE, lora.without_adapters(rm), seq,
                                                                     attn))  # step 0: B = 0
    part = lora.trainable(rm)
    assert lora.is_part(part) and not lora.is_part(rm) and set(part) == {"layers_0", "score"}
    assert jax.tree.structure(part) == jax.tree.structure({**lora.adapters(rm), "score": rm["score"]})
    on_base = lora.on_base(actor, part)  # the actor's trunk (its adapters and LM head dropped) + the part
    assert all(a is b for a, b in zip(jax.tree.leaves(lora.without_adapters(on_base)),
                                      jax.tree.leaves(lora.without_adapters(rm))))  # no copy

    loss = lambda p, ids, _: (jnp.mean(reward_model.score(SCORE, p, ids, attn) ** 2), {})
    grads = jax.jit(lambda p: common.accumulate_gradients(loss, p, seq, num_microbatches=1)[2])(rm)
    assert jax.tree.structure(grads) == jax.tree.structure(part)
    assert float(jnp.abs(grads["score"]["kernel"]).max()) > 0  # the head is trained
    assert _b_leaves(grads) and all(float(jnp.abs(g).max()) > 0 for g in _b_leaves(grads))  # B's, at B = 0
    state = common.TrainState.create(rm, optax.sgd(0.1))
    new = state.apply_gradients(grads, optax.sgd(0.1))
    trunk = lambda p: jax.tree.leaves({k: v for k, v in lora.without_adapters(p).items() if k != "score"})
    assert all(a is b for a, b in zip(trunk(new.params), trunk(rm)))  # the trunk passes through, untouched
    shared = dict(actor, value_head={"kernel": jnp.zeros((CFG.hidden_size, 1))})  # critic="shared"
    assert set(lora.trainable(shared)) == {"layers_0", "value_head"}


def test_ppo_iteration_with_lora_roles_on_one_base(roles):
    base, actor, rm = roles
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T), num_ppo_epochs=1, beta=0.05)
    tx = optax.adam(1e-2)
    _, critic = reward_model.init_from_policy(ACTOR, base, seed=4, copy=False)
    critic = lora.trainable(lora.add_adapters(SCORE, critic, jax.random.key(5)))
    rm_part = lora.trainable(_with_moved_b(rm, 6))
    with pytest.raises(ValueError, match="critic_params: give LoRA adapters to both"):
        ppo.init_state(cfg, ACTOR, base, tx, critic_model=SCORE, critic_params=critic, tx_critic=tx)
    state = ppo.init_state(cfg, ACTOR, actor, tx, critic_model=SCORE, critic_params=critic, tx_critic=tx,
                           reward=(SCORE, rm_part))
    assert state.ref_params is None  # no copy: the reference is the actor's base

    seq, attn = _sequences(seed=1)
    logp = jax.jit(common.response_logprobs, static_argnums=(0, 4))
    copy = jax.tree.map(np.array, base)  # a separately held base model
    ref = logp(ACTOR, ppo.reference_params(state), seq, attn, P)[0]
    np.testing.assert_array_equal(ref, logp(BASE_ACTOR, copy, seq, attn, P)[0])
    np.testing.assert_array_equal(ref, logp(ACTOR, state.actor.params, seq, attn, P)[0])  # step 0: B = 0

    iteration = ppo.make_iteration(ACTOR, SCORE, SCORE, tx, tx, cfg, donate=False)
    prompts, pmask = _sequences(8, seed=2)
    new, metrics = iteration(state, prompts[:, :P], pmask[:, :P], jax.random.key(7))
    assert float(metrics["kl/k1"]) == 0.0 and bool(metrics["finite"])  # the policy starts at its reference
    changed = lambda a, b: bool(jnp.any(a != b))
    assert all(not changed(a, b) for a, b in zip(jax.tree.leaves(lora.without_adapters(new.actor.params)),
                                                 jax.tree.leaves(copy)))
    assert all(map(changed, _b_leaves(new.actor.params), _b_leaves(actor)))  # the actor's adapters learn
    assert changed(new.critic.params["score"]["kernel"], critic["score"]["kernel"])
    assert jax.tree.structure(new.critic.params) == jax.tree.structure(critic)  # still a part alone
    assert new.reward_params is state.reward_params


@pytest.mark.heavy  # LoRA export: models/test_lora.py
def test_lora_reward_model_export_is_merged_and_loads_in_transformers(roles, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, _, rm = roles
    rm = _with_moved_b(rm, 8)
    seq, attn = _sequences(seed=3)
    expected = np.asarray(reward_model.score(SCORE, rm, seq, attn))
    _export_merged(SCORE, rm, tmp_path / "rm")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        got = hf(input_ids=torch.as_tensor(np.array(seq)), attention_mask=torch.as_tensor(np.array(attn, np.int64)))
    got = got.logits.numpy()[:, 0]
    plain = lora.without_adapters(rm)
    assert np.abs(expected - np.asarray(reward_model.score(BASE_SCORE, plain, seq, attn))).max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
