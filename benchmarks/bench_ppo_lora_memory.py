"""What LoRA saves in PPO's state: the bytes of its distinct device buffers (actor,
reference, critic, reward model, the two optimizer states), all weights vs LoRA.

All weights: the reference is a copy of the actor, critic and reward model each copy the
trunk (`reward_model.init_from_policy`), Adam moments for actor and critic. LoRA (every
phase on adapters, `docs/training.md`): one frozen base; the actor's adapters, the
critic's and the reward model's adapters and score heads (`lora.is_part`, on the actor's
base), Adam moments for the adapters and heads only. A buffer held by several roles is
counted once. This is the state between steps, not a step's peak (activations, gradients).

    python benchmarks/bench_ppo_lora_memory.py            # prints one JSON line
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax

from jaxrlhf.algorithms import ppo, reward_model
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.models import ModelConfig, Transformer, init_params, lora

CONFIG = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                     num_kv_heads=8, head_dim=64, max_position_embeddings=64, param_dtype="bfloat16", dtype="bfloat16")
RANKS = (8, 64)


def distinct_mib(tree) -> float:
    """MiB of the distinct device buffers among `tree`'s arrays."""
    return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.tree.leaves(tree)}.values()) / 2**20


def ppo_state(config: ModelConfig, base) -> ppo.PPOState:
    """PPO's state on `base` (copied first): all weights when `config.lora` is None, else
    every role on LoRA parts over the one base, as `runs.phases.ppo_phase` builds it."""
    cfg, tx = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=8)), optax.adam(1e-3)
    actor_model, base = Transformer(config), jax.tree.map(jnp.array, base)
    adapted = config.lora is not None
    actor = lora.add_adapters(actor_model, base, jax.random.key(1)) if adapted else base

    def role(seed):
        model, params = reward_model.init_from_policy(actor_model, base, seed=seed, copy=not adapted)
        return model, lora.trainable(lora.add_adapters(model, params, jax.random.key(seed))) if adapted else params

    (critic_model, critic), (rm_model, rm) = role(2), role(3)
    return ppo.init_state(cfg, actor_model, actor, tx, critic_model=critic_model, critic_params=critic, tx_critic=tx,
                          reward=(rm_model, rm))


def main():
    base = init_params(Transformer(CONFIG), jax.random.key(0))
    out = {"model_mib": distinct_mib(base), "all_weights_mib": distinct_mib(ppo_state(CONFIG, base))}
    for r in RANKS:
        out[f"lora_rank{r}_mib"] = distinct_mib(ppo_state(CONFIG.replace(lora=lora.LoraConfig(rank=r)), base))
    print(json.dumps({k: round(v, 1) for k, v in out.items()}))


if __name__ == "__main__":
    main()
