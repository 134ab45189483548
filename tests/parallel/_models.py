"""Tiny models, a small policy-gradient train step, and batches shared by the sharding checks.

Importable without touching devices (no jax computation at import).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from jaxrlhf import ops
from jaxrlhf.algorithms.common import response_logprobs
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import Transformer

# Every sharded dimension divides fsdp=4 and tensor=2: embed 32, vocab 128, 4 q / 2 kv
# heads, mlp 64. Llama with q/k/v/o biases; Qwen3 with q/k norms.
LLAMA = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, model_type="llama", qkv_bias=True, o_bias=True,
                    max_position_embeddings=64)
QWEN3 = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, model_type="qwen3", qk_norm=True, tie_word_embeddings=True,
                    max_position_embeddings=64)

P_LEN, T_LEN, ROWS = 6, 5, 8


def batch(seed: int = 0, rows: int = ROWS):
    """A policy-gradient batch: sequences `[B, P+T]`, masks, old log-probs, advantages."""
    r = np.random.default_rng(seed)
    seq = r.integers(3, 128, (rows, P_LEN + T_LEN)).astype(np.int32)
    attn = np.ones_like(seq, dtype=bool)
    attn[1, :2] = False  # a left-padded prompt
    lengths = r.integers(2, T_LEN + 1, rows)
    resp_mask = np.arange(T_LEN)[None] < lengths[:, None]
    attn[:, P_LEN:] = resp_mask
    return dict(sequences=seq, attention_mask=attn, response_mask=resp_mask.astype(np.float32),
                old_logp=(-4.0 + 0.1 * r.standard_normal((rows, T_LEN))).astype(np.float32),
                advantages=r.standard_normal((rows, T_LEN)).astype(np.float32))


def loss_fn(model: Transformer, params, b):
    logp, _, _ = response_logprobs(model, params, b["sequences"], b["attention_mask"], P_LEN)
    loss, metrics = ops.policy_loss(logp, b["old_logp"], b["advantages"], b["response_mask"])
    return loss, metrics


def make_step(model: Transformer, tx: optax.GradientTransformation):
    """`step(state, batch, rng) -> (state, metrics)` on a `TrainState`."""
    def step(state, b, rng):
        del rng
        (loss, metrics), grads = jax.value_and_grad(lambda p: loss_fn(model, p, b), has_aux=True)(state.params)
        state = state.apply_gradients(grads, tx)
        return state, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return step


def optimizer():
    """AdamW; its update is invariant to the gradient's scale, so the step also reports the
    loss and the gradient norm, which the checks compare too."""
    return optax.adamw(1e-3, eps=1e-6, weight_decay=0.01)


def scale_params(params, factor: float):
    """Larger weights make greedy decoding decisive (no near-ties that rounding could flip)."""
    return jax.tree.map(lambda x: x * factor if x.ndim > 1 else x, params)


def prompts(rows: int = 8, seed: int = 1):
    r = np.random.default_rng(seed)
    ids = r.integers(3, 128, (rows, P_LEN)).astype(np.int32)
    mask = np.ones_like(ids, dtype=bool)
    mask[0, :3] = False
    ids[0, :3] = 0
    return ids, mask
