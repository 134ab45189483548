"""The decoder-only transformer shared by the actor, critic, reference and reward model.

Pre-norm RMSNorm, rotary position embeddings, grouped-query attention and a gated MLP:
the Llama / Qwen2 / Qwen3 / Mistral / Gemma / Gemma 2 / Gemma 3 text families, which differ
only in switches of `ModelConfig` (Gemma's `x·(1+w)` norms, GeGLU, scaled embeddings,
sandwich norms and soft-capping; local sliding-window layers, each kind of layer with its
own rotary base).

Parameters are a plain pytree whose names mirror the Hugging Face checkpoint (`layers_3`
↔ `model.layers.3`), and every parameter carries logical axis names (`vocab`, `embed`,
`q_heads`, `kv_heads`, `head_dim`, `mlp`, `norm`) that sharding rules map onto a mesh.
With `config.scan_layers` the layers are one subtree `layers` whose leaves are stacked on a
leading `[num_layers]` axis named "layers", and the stack runs as one `jax.lax.scan`
(`hf_layout.stack_layers` / `unstack_layers` convert between the two layouts).

One `__call__` serves both the full forward (training, scoring) and incremental decoding
with a static-shape KV cache (sampling): the cache holds `S` slots, new tokens are written
at `cache_index`, and `attention_mask` then covers all `S` slots.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import attention
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import quant
from jaxrlhf.models.attention import AttentionMask
from jaxrlhf.models.config import REMAT_POLICIES, ModelConfig
from jaxrlhf.models.projection import Projection, _adapter, _init, _matmul_dtype, _rows_matmul

HEADS = ("lm", "score", "lm_value")


class KVCache(NamedTuple):
    """One layer's cache: keys (after RoPE) `[B, K, H, S]` and values `[B, K, S, H]`.

    A scanned stack (`config.scan_layers`) keeps one `KVCache` for all layers, with the
    layer axis second: keys `[B, n, K, H, S]`, values `[B, n, K, S, H]`. Batch stays the
    leading axis of every cache leaf in both layouts, so `jax.tree.map` over rows
    (repeating a prompt's cache for its samples) works on either.

    Both are laid out so that their attention matmul contracts a non-minor axis of the
    cache (`q·k` over H, `p·v` over S): a minor-axis contraction made XLA:CPU repack the
    whole key cache on every decode step (~9 % of a rollout's time, in a profile).
    """

    k: jax.Array
    v: jax.Array


class ModelOutput(NamedTuple):
    """`logits` `[B, L, V]` (head "lm"/"lm_value"), `values` `[B, L]` float32 (head
    "score"/"lm_value"), `hidden` `[B, L, D]` after the final norm, and the updated cache."""

    logits: jax.Array | None
    values: jax.Array | None
    hidden: jax.Array
    cache: tuple[KVCache, ...] | KVCache | None


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> tuple[KVCache, ...] | KVCache:
    """An empty cache of `max_len` slots for each layer, in `dtype` (default: the config's
    `cache_dtype`, else its compute dtype): a tuple of per-layer `KVCache`s, or with
    `config.scan_layers` one `KVCache` whose leaves hold all layers on axis 1."""
    dtype = jnp.dtype(dtype or config.cache_dtype or config.dtype)
    b, n, k, s, h = batch_size, config.num_layers, config.num_kv_heads, max_len, config.head_dim
    if config.scan_layers:
        return KVCache(jnp.zeros((b, n, k, h, s), dtype), jnp.zeros((b, n, k, s, h), dtype))
    return tuple(KVCache(jnp.zeros((b, k, h, s), dtype), jnp.zeros((b, k, s, h), dtype))
                 for _ in range(n))


def grow_cache(cache, slots: int):
    """`cache` (either layout of `init_cache`) with empty slots appended up to `slots`: slot
    s keeps its keys and values, so a decode loop can attend over the first slots only and
    grow its cache as the responses grow (`rollout.sampler.decode_windows`)."""
    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, slots - x.shape[axis])
        return jnp.pad(x, widths)
    grow = lambda kv: KVCache(pad(kv.k, -1), pad(kv.v, -2))  # keys [.., H, S], values [.., S, H]
    return grow(cache) if isinstance(cache, KVCache) else tuple(map(grow, cache))


def _cache_slots(config: ModelConfig, cache) -> int:
    """S, the slot count of a cache in the layout the config expects (else a ValueError)."""
    n = config.num_layers
    if config.scan_layers:
        if not isinstance(cache, KVCache) or cache.v.ndim != 5 or cache.v.shape[1] != n:
            raise ValueError(f"a scanned stack (scan_layers=True) takes one KVCache of [B, {n}, K, ., .] "
                             "arrays from init_cache; got " + str(jax.tree.map(jnp.shape, cache)))
        return cache.v.shape[3]
    if isinstance(cache, KVCache) or len(cache) != n:
        raise ValueError(f"cache has {1 if isinstance(cache, KVCache) else len(cache)} layers, the model {n} "
                         "(an unrolled stack takes a tuple of per-layer KVCaches from init_cache)")
    return cache[0].v.shape[2]


def remat_policy(config: ModelConfig):
    """The `jax.checkpoint` policy that `config.remat` names (not for "none": no checkpoint).

    "full" → None (save nothing but the layer's input), "dots" → save the outputs of matmuls
    without batch dimensions (every projection: `Projection` flattens its rows into one 2-D
    matmul; the attention einsums are batched, so their scores are recomputed), "offload" →
    the same values moved to pinned host memory, which the backend must have.
    """
    if config.remat == "full":
        return None
    if config.remat == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if config.remat == "offload":
        try:
            kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
        except Exception:  # a backend without memory spaces
            kinds = set()
        if "pinned_host" not in kinds:
            raise ValueError(f"remat='offload' needs 'pinned_host' memory, which the {jax.default_backend()} "
                             f"backend lacks (it has {sorted(kinds)}); choose remat='dots' or 'full'")
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"remat={config.remat!r} has no checkpoint policy; expected one of {list(REMAT_POLICIES[1:])}")


def positions_from_mask(mask_BxS: jax.Array) -> jax.Array:
    """Position ids that skip padding: the `i`-th valid token gets position `i`.

    Left-padded prompts thus start at position 0 like unpadded ones (the padding slots get 0,
    they are never attended to).
    """
    return jnp.maximum(jnp.cumsum(mask_BxS.astype(jnp.int32), axis=1) - 1, 0)


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics: `w · x̂` (Llama: `x̂` cast to the compute dtype, then
    scaled), or with `plus_one` Gemma's `(1 + w) · x̂` in float32, then cast (its `w` starts at 0)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    axis: str = "norm"
    plus_one: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, (self.axis,)), (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


def _norm(c: ModelConfig, name: str, axis: str = "norm") -> RMSNorm:
    """The config's RMSNorm, named `name`."""
    return RMSNorm(c.rms_norm_eps, jnp.dtype(c.dtype), jnp.dtype(c.param_dtype), axis, c.norm_plus_one, name=name)


def _rotate(x_BxLxNxH, cos_BxLxH, sin_BxLxH):
    half = x_BxLxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxLxNxH[..., half:], x_BxLxNxH[..., :half]], axis=-1)
    return x_BxLxNxH * cos_BxLxH[:, :, None, :] + rotated * sin_BxLxH[:, :, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention; `window`: a local layer's sliding window, or None."""

    config: ModelConfig
    window: int | None = None

    @nn.compact
    def __call__(self, x_BxLxD, cos_BxLxH, sin_BxLxH, mask: AttentionMask, kv: KVCache | None, cache_index,
                 queries: int | None = None):
        """`queries`: attend from the last `queries` positions only (keys and values still
        cover all L); the output then has `queries` positions."""
        c = self.config
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        tail = slice(None) if queries is None else slice(-queries, None)
        qkv_bias = lambda heads: (heads, "head_dim") if c.qkv_bias else None
        proj = lambda name, shape, axes, bias, n_out=None: Projection(
            shape, axes, bias, dt, pdt, n_out, _adapter(c, f"self_attn/{name}"), c.quantize, _matmul_dtype(c),
            name=name)
        q = proj("q_proj", (d, n, h), ("embed", "q_heads", "head_dim"), qkv_bias("q_heads"))(x_BxLxD[:, tail])
        key = proj("k_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), qkv_bias("kv_heads"))(x_BxLxD)
        val = proj("v_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), qkv_bias("kv_heads"))(x_BxLxD)
        if c.qk_norm:
            q = _norm(c, "q_norm", "head_dim")(q)
            key = _norm(c, "k_norm", "head_dim")(key)
        q = _rotate(q, cos_BxLxH[:, tail], sin_BxLxH[:, tail]).astype(dt)
        # Keys/values are head-major (kv heads before positions) so that both attention
        # matmuls read the cache in place; a [B, S, K, H] cache costs a full transpose of it
        # per decode step.
        key_BxKxLxH = _rotate(key, cos_BxLxH, sin_BxLxH).astype(dt).transpose(0, 2, 1, 3)
        val_BxKxLxH = val.transpose(0, 2, 1, 3)

        if kv is None:
            keys, values, keys_transposed = key_BxKxLxH, val_BxKxLxH, False
        else:
            key_BxKxHxL = key_BxKxLxH.transpose(0, 1, 3, 2)
            if jnp.ndim(cache_index) == 1:  # each row at its own slots (continuous batching)
                row = lambda ax: lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u.astype(c.dtype), i, ax)
                kv = KVCache(jax.vmap(row(2))(kv.k, key_BxKxHxL, cache_index),
                             jax.vmap(row(1))(kv.v, val_BxKxLxH, cache_index))
            else:
                kv = KVCache(
                    jax.lax.dynamic_update_slice(kv.k, key_BxKxHxL.astype(kv.k.dtype), (0, 0, 0, cache_index)),
                    jax.lax.dynamic_update_slice(kv.v, val_BxKxLxH.astype(kv.v.dtype), (0, 0, cache_index, 0)))
            keys, values, keys_transposed = kv.k, kv.v, True
        if queries is not None:
            mask = AttentionMask(mask.key_valid, mask.query_slot[..., -queries:])
        out_BxLxNxH = attention.attend(q, keys, values, mask, implementation=c.attention, scale=c.attention_scale,
                                       window=self.window, soft_cap=c.attn_logit_softcapping,
                                       keys_transposed=keys_transposed, queries_are_keys=kv is None and queries is None)
        out = proj("o_proj", (n, h, d), ("q_heads", "head_dim", "embed"), ("embed",) if c.o_bias else None,
                   n_out=1)(out_BxLxNxH)
        return out, kv


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c = self.config
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        d, f = c.hidden_size, c.intermediate_size
        bias = lambda ax: (ax,) if c.mlp_bias else None
        proj = lambda name, shape, axes, b: Projection(shape, axes, b, dt, pdt, lora=_adapter(c, f"mlp/{name}"),
                                                       quantize=c.quantize, matmul_dtype=_matmul_dtype(c), name=name)
        gate = proj("gate_proj", (d, f), ("embed", "mlp"), bias("mlp"))(x_BxLxD)
        up = proj("up_proj", (d, f), ("embed", "mlp"), bias("mlp"))(x_BxLxD)
        act = _ACTIVATIONS[c.hidden_act]
        return proj("down_proj", (f, d), ("mlp", "embed"), bias("embed"))(act(gate) * up)


# `ModelConfig.hidden_act` -> the gate's activation (SwiGLU, GeGLU with tanh-approximated GELU).
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class DecoderLayer(nn.Module):
    """One pre-norm layer. With `config.sandwich_norms` (Gemma 2/3) the attention output is
    normed (`post_attention_layernorm`) before the residual add, and the MLP sits between
    `pre_feedforward_layernorm` and `post_feedforward_layernorm`; otherwise
    `post_attention_layernorm` is the MLP's input norm (Llama). `local`: a sliding-window
    layer (`config.sliding_window`)."""

    config: ModelConfig
    local: bool = False

    @nn.compact
    def __call__(self, x_BxLxD, cos, sin, mask: AttentionMask, kv, cache_index, queries: int | None = None):
        c = self.config
        window = c.sliding_window if self.local else None
        attn_out, kv = Attention(c, window, name="self_attn")(
            _norm(c, "input_layernorm")(x_BxLxD), cos, sin, mask, kv, cache_index, queries)
        if queries is not None:
            x_BxLxD = x_BxLxD[:, -queries:]
        if c.sandwich_norms:
            attn_out = _norm(c, "post_attention_layernorm")(attn_out)
        x_BxLxD = x_BxLxD + attn_out
        mlp_out = MLP(c, name="mlp")(_norm(c, "pre_feedforward_layernorm" if c.sandwich_norms
                                           else "post_attention_layernorm")(x_BxLxD))
        if c.sandwich_norms:
            mlp_out = _norm(c, "post_feedforward_layernorm")(mlp_out)
        return x_BxLxD + mlp_out, kv


class Transformer(nn.Module):
    """Decoder with a language-model head, a scalar head, or both.

    head: "lm" (actor / reference), "score" (critic or reward model: a scalar per position,
      HF `*ForSequenceClassification` with one label), "lm_value" (actor-critic on a shared
      trunk: LM head plus a `value_head`).
    """

    config: ModelConfig
    head: str = "lm"

    @nn.compact
    def __call__(
        self,
        input_ids_BxL: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        cache: Sequence[KVCache] | None = None,
        cache_index: jax.Array | int | None = None,
        compute_logits: bool = True,
        last_position_only: bool = False,
    ) -> ModelOutput:
        """Forward pass.

        Args:
          input_ids_BxL: int token ids `[B, L]`.
          attention_mask: `[B, L]` (no cache) or `[B, S]` over all cache slots (with cache);
            1 for real tokens. Defaults to all ones.
          position_ids: `[B, L]`; by default the count of valid tokens before each one, so
            left padding does not shift positions.
          cache: from `init_cache` (S slots) or a previous call; the new keys/values are
            written at slots `cache_index .. cache_index + L - 1`; an int32 `[B]`
            `cache_index` puts each row at its own slots (`rollout.continuous`).
          compute_logits: False skips the `[B, L, V]` LM head (the caller may project
            `hidden` itself in chunks).
          last_position_only: the last layer attends and runs its MLP from the last
            position only, and `hidden` / `logits` / `values` cover that position (`L = 1`);
            every layer still writes all L keys and values into the cache. A prefill that
            needs only the next token's logits skips ~1/num_layers of its matmuls.
        """
        c = self.config
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r}; expected one of {HEADS}")
        if input_ids_BxL.ndim != 2:
            raise ValueError(f"input_ids must have shape [B, L], got {input_ids_BxL.shape}")
        b, l = input_ids_BxL.shape
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)

        if cache is None:
            mask = jnp.ones((b, l), bool) if attention_mask is None else attention_mask.astype(bool)
            if mask.shape != (b, l):
                raise ValueError(f"attention_mask must have shape [B, L] = {(b, l)}, got {mask.shape}")
            if position_ids is None:
                position_ids = positions_from_mask(mask)
            attn_mask = AttentionMask(mask, jnp.arange(l, dtype=jnp.int32))
            cache_index = 0
        else:
            if cache_index is None:
                raise ValueError("cache_index is required when a cache is given")
            s = _cache_slots(c, cache)
            mask = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
            if mask.shape != (b, s):
                raise ValueError(f"with a cache, attention_mask must cover all cache slots: "
                                 f"expected [B, S] = {(b, s)}, got {mask.shape}")
            per_row = jnp.ndim(cache_index) == 1  # each row at its own slots: query slots [B, L]
            if per_row and jnp.shape(cache_index) != (b,):
                raise ValueError(f"a per-row cache_index must have shape [B] = ({b},), got {jnp.shape(cache_index)}")
            query_slot = (cache_index[:, None] if per_row else cache_index) + jnp.arange(l, dtype=jnp.int32)
            if position_ids is None:
                position_ids = (jnp.take_along_axis(positions_from_mask(mask), query_slot, axis=1) if per_row else
                                jax.lax.dynamic_slice_in_dim(positions_from_mask(mask), cache_index, l, axis=1))
            attn_mask = AttentionMask(mask, query_slot)

        shared = _rope(c, position_ids, False)  # local layers differ only with a base of their own
        ropes = {local: _rope(c, position_ids, True) if local and c.local_rope_theta is not None else shared
                 for local in set(c.local_layers())}

        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=dt, param_dtype=pdt,
                         embedding_init=nn.with_logical_partitioning(_init, ("vocab", "embed")),
                         name="embed_tokens")
        x = embed(input_ids_BxL)
        if c.scan_layers:
            # Params without adapters are the base model (the reference), float ones the model
            # before QLoRA quantised it: their shapes are checked against a stack like them.
            stored = None if self.is_initializing() else self.get_variable("params", "layers")
            like = c if stored is None else c.replace(
                lora=c.lora if lora_lib.has_adapters(stored) else None,
                quantize=c.quantize if quant.has_quantized(stored) else "none")
            layers = self.param("layers", _init_stacked_layers, like)
            dropout = c.lora is not None and c.lora.dropout > 0 and self.has_rng("dropout")
            x, new_cache = scan_layers(c, layers, _embed_scaled(c, x), ropes, attn_mask, cache, cache_index,
                                       last_position_only=last_position_only,
                                       dropout_rng=self.make_rng("dropout") if dropout else None)
        else:
            x = _embed_scaled(c, x)
            # `queries` (argument 7, counting self) is a Python int or None that shapes the layer.
            layer_cls = DecoderLayer if c.remat == "none" else nn.remat(
                DecoderLayer, static_argnums=(7,), policy=remat_policy(c))
            new_cache = []
            for i, local in enumerate(c.local_layers()):
                queries = 1 if last_position_only and i == c.num_layers - 1 else None
                x, kv = layer_cls(c, local, name=f"layers_{i}")(x, *ropes[local], attn_mask,
                                                                 None if cache is None else cache[i], cache_index,
                                                                 queries)
                new_cache.append(kv)
            new_cache = None if cache is None else tuple(new_cache)
        hidden = _norm(c, "norm")(x)

        logits = values = None
        if self.head in ("lm", "lm_value") and compute_logits:
            logits = self.lm_logits(hidden, embed)
        if self.head == "lm_value":
            values = Projection((c.hidden_size, 1), ("embed", None), None, dt, pdt,
                            name="value_head")(hidden)[..., 0].astype(jnp.float32)
        if self.head == "score":
            values = Projection((c.hidden_size, 1), ("embed", None), None, dt, pdt,
                            name="score")(hidden)[..., 0].astype(jnp.float32)
        if self.head in ("lm", "lm_value") and not compute_logits and self.is_initializing():
            self.lm_logits(hidden, embed)  # create the LM head's params anyway
        return ModelOutput(logits, values, hidden, new_cache)

    @jax.named_scope("lm_head")
    def lm_logits(self, hidden_BxLxD, embed: nn.Embed):
        """The LM head's logits `[B, L, V]` (soft-capped where the config says)."""
        c = self.config
        if c.tie_word_embeddings:
            dt = jnp.dtype(c.dtype)  # `embed.attend`, with the rows flattened
            logits = _rows_matmul(hidden_BxLxD.astype(dt), embed.embedding.astype(dt).T)
        else:
            logits = Projection((c.hidden_size, c.vocab_size), ("embed", "vocab"), None, jnp.dtype(c.dtype),
                                jnp.dtype(c.param_dtype), lora=_adapter(c, lora_lib.LM_HEAD),
                                name="lm_head")(hidden_BxLxD)
        return attention.capped(logits, c.final_logit_softcapping)


def _rope(c: ModelConfig, position_ids_BxL: jax.Array, local: bool):
    """`(cos, sin)` `[B, L, head_dim]` in the compute dtype for the global or local layers."""
    inv_freq = jnp.asarray(c.inv_freq(local), jnp.float32)
    angles = position_ids_BxL.astype(jnp.float32)[..., None] * inv_freq
    # The two halves share their angles: XLA:CPU calls scalar libm sin/cos per element,
    # so taking them on the half and duplicating halves that cost.
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    dt = jnp.dtype(c.dtype)
    return jnp.concatenate([cos, cos], axis=-1).astype(dt), jnp.concatenate([sin, sin], axis=-1).astype(dt)


def _embed_scaled(c: ModelConfig, x_BxLxD: jax.Array) -> jax.Array:
    """Gemma's embeddings times `sqrt(hidden_size)` (rounded to the compute dtype, as
    transformers rounds it to the weights'); other families' as they are."""
    return x_BxLxD * jnp.asarray(c.hidden_size ** 0.5, x_BxLxD.dtype) if c.scale_embeddings else x_BxLxD


def _init_stacked_layers(rng: jax.Array, config: ModelConfig):
    """`num_layers` draws of a `DecoderLayer`'s params (one key each), stacked on a leading
    axis whose logical name "layers" is prepended to every parameter's names."""
    c = config
    x = jnp.zeros((1, 1, c.hidden_size), jnp.dtype(c.dtype))
    angle = jnp.zeros((1, 1, c.head_dim), jnp.dtype(c.dtype))
    mask = AttentionMask(jnp.ones((1, 1), bool), jnp.zeros((1,), jnp.int32))
    init_one = lambda key: DecoderLayer(c).init(key, x, angle, angle, mask, None, 0)["params"]
    boxed = jax.vmap(init_one)(jax.random.split(rng, c.num_layers))
    return jax.tree.map(lambda b: b.replace(names=("layers",) + tuple(b.names)), boxed,
                        is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


_LAYOUT_OPS = ("reshape", "broadcast_in_dim", "transpose", "convert_element_type", "squeeze", "expand_dims")


def _save_all_but_layout(prim, *_, **__) -> bool:
    """A `jax.checkpoint` policy: save every value but the outputs of layout ops."""
    return prim.name not in _LAYOUT_OPS


def scan_layers(config: ModelConfig, layers, x_BxLxD, ropes, mask: AttentionMask, cache: KVCache | None,
                cache_index, *, last_position_only: bool = False, dropout_rng: jax.Array | None = None):
    """The decoder stack as one `jax.lax.scan` over stacked layer params: `(x, cache)`.

    `ropes`: `{local: (cos, sin)}` for the kinds of layer the stack has. A stack of local
    and global layers (Gemma 2/3) scans over `config.local_layers()` too, and each step
    runs its kind through a `lax.cond` (both kinds compiled once).

    Step i applies `DecoderLayer` with params `layers[i]` (every leaf `[n, ...]`) to the
    carried `x`; the cache (`[B, n, ...]` leaves, see `KVCache`) is carried whole, and step
    i reads its layer's slice `cache[:, i]` and writes it back updated, in place. The body is
    compiled once, whatever `num_layers`. The body is a `jax.checkpoint` under the policy of
    `config.remat`, so the backward pass keeps (stacked over layers) only what it saves.
    Under "none" that is every value but the outputs of layout ops (reshapes, transposes,
    broadcasts, casts), which are recomputed: saved, the q/k/v/o kernels reshaped to 2-D
    would be a second copy of the stacked weights (SmolLM2-135M shape, 8 layers: XLA temp
    412 -> 357 MiB).

    `last_position_only`: step n-1 takes the other branch of a `lax.cond`, which runs the
    layer with `queries=1` and writes its output at the last position of the carry, so the
    last layer skips all but one position's attention and MLP without slicing (copying)
    the stacked params; the returned `x` is then `[B, 1, D]`.

    `dropout_rng`: LoRA adapter dropout on (training, `models.lora`); layer i draws its
    masks from `fold_in(dropout_rng, i)`, so no two layers share one. None: off.
    """
    c = config
    n = c.num_layers

    def one_kind(p, x, kv, queries, local, key):
        rngs = None if key is None else {"dropout": key}
        return DecoderLayer(c, local).apply({"params": p}, x, *ropes[local], mask, kv, cache_index, queries,
                                            rngs=rngs)

    policy = _save_all_but_layout if c.remat == "none" else remat_policy(c)
    one_kind = jax.checkpoint(one_kind, policy=policy, prevent_cse=False, static_argnums=(3, 4))
    kinds = sorted(ropes)
    layer_of = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, axis=1, keepdims=False)

    def body(carry, xs):
        x, stacked = carry
        p, i, is_local = xs

        key = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)

        def layer(p, x, kv, queries):
            if len(kinds) == 1:
                return one_kind(p, x, kv, queries, kinds[0], key)
            return jax.lax.cond(is_local, lambda: one_kind(p, x, kv, queries, True, key),
                                lambda: one_kind(p, x, kv, queries, False, key))

        kv = None if stacked is None else jax.tree.map(lambda a: layer_of(a, i), stacked)
        if last_position_only:
            def last():
                y, kv_new = layer(p, x, kv, 1)
                return x.at[:, -1:].set(y), kv_new
            x, kv = jax.lax.cond(i == n - 1, last, lambda: layer(p, x, kv, None))
        else:
            x, kv = layer(p, x, kv, None)
        if stacked is not None:
            stacked = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u, i, axis=1), stacked, kv)
        return (x, stacked), None

    xs = (layers, jnp.arange(n, dtype=jnp.int32), jnp.asarray(c.local_layers(), bool))
    (x, cache), _ = jax.lax.scan(body, (x_BxLxD, cache), xs)
    return (x[:, -1:] if last_position_only else x), cache


@jax.named_scope("lm_head")
def project_logits(config: ModelConfig, params, hidden_BxLxD: jax.Array) -> jax.Array:
    """The LM head applied to final hidden states `[..., D] -> [..., V]`, outside `apply`.

    Lets callers project only the positions they need (the sampler's last prompt token, or
    chunks of a long response) instead of materialising `[B, L, V]` logits.
    """
    logits = _rows_matmul(hidden_BxLxD.astype(jnp.dtype(config.dtype)), lm_head_weight(config, params))
    return attention.capped(logits, config.final_logit_softcapping)


def lm_head_rows(config: ModelConfig, params) -> jax.Array:
    """The LM head as `[V, D]` rows in the compute dtype (`lm_head_weight(...).T`): the tied
    embedding itself, else a transposed copy of the `lm_head` kernel (adapter folded in).
    A sampler takes it once before its decode loop for `vocab_major_logits`."""
    return lm_head_weight(config, params).T  # tied: `embedding.T.T`, which XLA folds to the embedding


@jax.named_scope("lm_head")
def vocab_major_logits(config: ModelConfig, head_VxD: jax.Array, hidden_NxD: jax.Array) -> jax.Array:
    """`[N, V]` logits of a few rows (a decode step) from the `[V, D]` head rows of
    `lm_head_rows`: computed as the `[V, N]` product `head @ hidden.T`, then transposed. The
    optimisation barrier keeps XLA from folding the transpose back into the dot, whose
    `[N, V]` form reads the head across its rows: on XLA:CPU the vocab-major product of a
    SmolLM2-sized head ([49152, 576]) took 9.4 against 18.9 ms at N = 8 and 15.0 against
    27.3 ms at N = 16 (docs/benchmarks.md, "The LM head of a decode step"); the [N, V]
    transpose after it is a few MB. Same numbers as `project_logits` up to the dots'
    summation order."""
    hidden = hidden_NxD.astype(head_VxD.dtype)
    logits = jax.lax.optimization_barrier(head_VxD @ hidden.T).T
    return attention.capped(logits, config.final_logit_softcapping)


def lm_head_weight(config: ModelConfig, params) -> jax.Array:
    """The LM head as `w [D, V]` in the compute dtype: `embedding.T` when tied, else the
    `lm_head` kernel, with its LoRA adapter folded in when it has one (what
    `project_logits` multiplies by, before any final soft cap)."""
    dt = jnp.dtype(config.dtype)
    if config.tie_word_embeddings:
        return params["embed_tokens"]["embedding"].astype(dt).T
    head = params["lm_head"]
    if "lora_a" in head:  # an adapted head: W + s A B (the same numbers as its Projection, up to rounding)
        return (head["kernel"].astype(jnp.float32) + lora_lib.delta_weight(head, config.lora.scale)).astype(dt)
    return head["kernel"].astype(dt)


def init_params(model: Transformer, rng: jax.Array, *, seq_len: int = 8):
    """Random parameters (HF-style N(0, 0.02) init, norm gains 1) as a plain pytree."""
    variables = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))
    return nn.unbox(variables["params"])


def logical_axes(model: Transformer):
    """A pytree like the params whose leaves are tuples of logical axis names."""
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))
    return jax.tree.map(lambda x: tuple(x.names), abstract["params"],
                        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def score_at_last_token(values_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """The scalar at the last valid position of each row: the reward model's score `[B]`.

    Works with left padding (prompt) and right padding (response) alike, since it reads the
    highest index whose mask is set. A row without valid tokens reads position 0.
    """
    idx = jnp.max(jnp.where(mask_BxL.astype(bool), jnp.arange(values_BxL.shape[1])[None], 0), axis=1)
    return jnp.take_along_axis(values_BxL, idx[:, None], axis=1)[:, 0]


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
