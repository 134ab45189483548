"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections, functionally.

A targeted `transformer.Projection` computes `y = x W + s · (x A) B` with `A [in..., r]`
and `B [r, out...]` two more parameters beside its kernel (`lora_a`, `lora_b`, float32
whatever the kernel's dtype), `s = alpha / r` (rsLoRA: `alpha / sqrt(r)`). With adapter
dropout p > 0 (PEFT's `lora_dropout`) the adapter's input is dropped in training:
`y = x W + s · (drop_p(x) A) B`, kept values scaled by `1 / (1 − p)`; it is on only when
the model is applied with a dropout key (`rngs={"dropout": key}`, which the training losses
pass: `algorithms.common.dropout_key`), never in sampling, scoring, the reference or export. `B` starts at 0,
so a fresh adapter leaves the model exactly as it was. A projection computes the adapter
term only where its params hold `lora_a`: the same params with the adapters dropped
(`without_adapters`, no copy of any array) are the base model — the reference policy of
GRPO, PPO and DPO.

Training only the adapters is a partition of the one params pytree: `trainable(params)`
(the adapter leaves and any new head of `HEADS` — a critic's value head, a reward model's
score head —, or all of them when there are no adapters) is what the optimizer and the
gradient see, `with_trainable(params, new)` puts them back
(`algorithms.common.TrainState`, `accumulate_gradients`). The base is an argument the
gradient is never taken for: no base-sized gradient nor optimizer state exists.

A role trained on another's frozen base (PPO's LoRA critic and reward model on the
actor's base) may hold only its trained part (`is_part`); `on_base(base, part)` is its
full params, sharing the base's arrays.

Adapters carry their kernel's logical axes (`A`: the kernel's input axes, `B`: its output
axes; the rank axis unsharded), so the sharding rules place them like their kernel.

Targets are regexes searched in each projection's path inside a layer
("self_attn/q_proj", "mlp/down_proj") or "lm_head" (an untied LM head); every layer of
the stack gets the same adapters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

PyTree = Any

# Every projection an adapter can sit on: its path inside a layer (or the model, for the LM head).
PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
               "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
LM_HEAD = "lm_head"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_KEYS = ("lora_a", "lora_b")
# Heads a model with adapters trains in full: new ones, not in the base (PPO's value head on
# the actor's trunk or a critic's/reward model's score head). An LM head is part of the base.
HEADS = ("value_head", "score")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters and how they are scaled.

    rank: r > 0, the inner dimension of `A [in, r]` and `B [r, out]`.
    alpha: the scale's numerator: `s = alpha / r`, or `alpha / sqrt(r)` with `rslora`
      (Kalajdzievski 2023: keeps the update's size independent of r).
    targets: regexes, each searched in the projection paths of `PROJECTIONS` (and
      "lm_head" when the head is not tied); each must match at least one
      (`check_targets`).
    dropout: p in [0, 1), the probability that an element of the adapter's input is
      dropped when the model is applied with a dropout key (training only; the base path
      never sees it). 0 = off: no key is threaded and the programs are those without it.
    """

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", parse_targets(self.targets))
        if not isinstance(self.rank, (int, np.integer)) or self.rank <= 0:
            raise ValueError(f"model.lora.rank={self.rank!r}: the adapters' rank must be an integer > 0 "
                             "(rank 0 in a run config turns LoRA off)")
        if not isinstance(self.dropout, (int, float, np.integer, np.floating)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout!r}: the adapters' dropout probability must be "
                             "a number in [0, 1) (0 = off)")
        if not self.targets:
            raise ValueError("model.lora.targets is empty: name the projections to adapt, e.g. 'q_proj,v_proj'")
        for t in self.targets:
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"model.lora.targets: {t!r} is not a regular expression ({e})") from None

    @property
    def scale(self) -> float:
        """`s` of `y = x W + s · (x A) B`."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def adapts(self, path: str) -> bool:
        """Whether the projection at `path` ("self_attn/q_proj", "lm_head") gets an adapter."""
        return any(re.search(t, path) for t in self.targets)


def parse_targets(text: str) -> tuple[str, ...]:
    """"q_proj, v_proj" -> ("q_proj", "v_proj"): the comma-separated form of the config."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def candidates(config) -> tuple[str, ...]:
    """The paths a target can match on a model of `config` (a `ModelConfig`)."""
    return PROJECTIONS + (() if config.tie_word_embeddings else (LM_HEAD,))


def check_targets(config) -> None:
    """A clear error naming `model.lora.targets` when one of its patterns matches no
    projection of the model (or asks for the LM head of a model that ties it)."""
    lora = config.lora
    paths = candidates(config)
    for t in lora.targets:
        if any(re.search(t, p) for p in paths):
            continue
        if re.search(t, LM_HEAD) and config.tie_word_embeddings:
            raise ValueError(f"model.lora.targets: {t!r} asks for the LM head, but this model ties it to the "
                             "input embeddings (tie_word_embeddings): there is no lm_head to adapt; drop it")
        raise ValueError(f"model.lora.targets: {t!r} matches no projection; the candidates are {list(paths)}")


def from_section(section) -> LoraConfig | None:
    """`config.model.lora` (rank, alpha, targets, rslora, dropout) -> a `LoraConfig`, or None for rank 0."""
    if section.rank == 0:
        return None
    return LoraConfig(rank=section.rank, alpha=float(section.alpha), targets=parse_targets(section.targets),
                      rslora=bool(section.rslora), dropout=float(section.dropout))


# ----------------------------------------------------------------------------- params partition


def _is_adapter_path(path) -> bool:
    return bool(path) and getattr(path[-1], "key", None) in ADAPTER_KEYS


def _trained_leaf(path) -> bool:
    """An adapter leaf, or a leaf under a head of `HEADS`."""
    return _is_adapter_path(path) or any(getattr(k, "key", None) in HEADS for k in path)


def has_adapters(params: PyTree) -> bool:
    """Whether `params` holds any adapter (a static fact of the tree's structure)."""
    return any(_is_adapter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _filter(params: Mapping, keep, prefix=()) -> dict:
    """The nested dicts of `params` with only the leaves `keep(path)` accepts (a path of
    `jax.tree_util.DictKey`s, as `tree_flatten_with_path` gives; empty dicts dropped)."""
    out = {}
    for k, v in params.items():
        path = prefix + (jax.tree_util.DictKey(k),)
        if isinstance(v, Mapping):
            sub = _filter(v, keep, path)
            if sub:
                out[k] = sub
        elif keep(path):
            out[k] = v
    return out


def adapters(params: PyTree) -> dict:
    """Only the adapter leaves of `params`, in their nested dicts."""
    return _filter(params, _is_adapter_path)


def without_adapters(params: PyTree) -> dict:
    """`params` with every adapter dropped: the base model, sharing its arrays (no copy)."""
    return _filter(params, lambda path: not _is_adapter_path(path))


def trainable(params: PyTree) -> PyTree:
    """What training updates: when `params` has adapters, they and the new heads of `HEADS`
    (a value or score head is trained in full on a frozen, adapted trunk); else all of
    `params`. Works on any tree keyed like params (PPO's `{"actor": ..., "critic": ...}`,
    a tree of shardings)."""
    return _filter(params, _trained_leaf) if has_adapters(params) else params


def is_part(params: PyTree) -> bool:
    """Whether `params` are a trained part alone (adapters and heads, no base weight): a
    role that runs on another role's frozen base (`on_base`)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return any(_is_adapter_path(p) for p, _ in flat) and all(_trained_leaf(p) for p, _ in flat)


def on_base(base: PyTree, part: PyTree) -> dict:
    """The full params of a role whose trained `part` (`trainable` of it: adapters and its
    head) sits on another role's frozen `base` (e.g. PPO's actor params): the base's
    trunk (its adapters, LM head and `HEADS` dropped) with `part` put in; no array copied."""
    trunk = {k: v for k, v in without_adapters(base).items() if k not in (LM_HEAD, *HEADS)}
    return _merge_trees(trunk, part)


def with_trainable(params: PyTree, new: PyTree) -> PyTree:
    """`params` with `trainable(params)` replaced by `new` (the inverse of `trainable`)."""
    return _merge_trees(params, new) if has_adapters(params) else new


# ----------------------------------------------------------------------------- init and merge


def add_adapters(model, params: PyTree, rng: jax.Array) -> PyTree:
    """`params` of the base model with fresh adapters added where `model.config.lora` says.

    `model` is a `Transformer` whose config has `lora`; `params` its params without
    adapters (a loaded checkpoint, a fresh init). `A` is drawn as in PEFT (Kaiming-uniform,
    bound `1/sqrt(fan_in)`), `B = 0`. Only the adapters are computed: the base params of
    `model.init` are dead code in the jit (no second copy of the model is made).
    """
    check_targets(model.config)
    if has_adapters(params):
        raise ValueError("add_adapters: the params already hold adapters")
    fresh = jax.jit(lambda key: adapters(nn.unbox(model.init(key, jnp.zeros((1, 2), jnp.int32))["params"])))(rng)
    return _merge_trees(params, fresh)


def _merge_trees(base: Mapping, extra: Mapping) -> dict:
    """`base` with the leaves of `extra` put in at their paths (nested dicts copied, arrays not)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge_trees(base.get(k, {}), v) if isinstance(v, Mapping) else v
    return out


def init_a(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    """`A [in..., r]`: uniform in ±1/sqrt(fan_in), fan_in the input size (PEFT's
    `kaiming_uniform_(a=√5)` on `lora_A`); one layer's shape (a scanned stack draws each
    layer's separately)."""
    fan_in = int(np.prod(shape[:-1]))
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def adapted_kernels(params: Mapping, prefix=()):
    """`(path, node)` of every dict in `params` that holds `lora_a` (a `Projection`'s params)."""
    for k, v in params.items():
        if isinstance(v, Mapping):
            if "lora_a" in v:
                yield prefix + (k,), v
            else:
                yield from adapted_kernels(v, prefix + (k,))


def delta_weight(node: Mapping, scale: float) -> jax.Array:
    """`s · A B` shaped like the kernel of the projection whose params are `node`, float32.

    Works for a scanned stack too: with a leading `[num_layers]` axis on all three
    (the kernel's input axes are `A`'s but its last).
    """
    a, b, w = node["lora_a"], node["lora_b"], node["kernel"]
    lead = a.ndim + b.ndim - 2 - w.ndim  # 1 for a scanned stack's leading layer axis, else 0
    r = a.shape[-1]
    k = int(np.prod(a.shape[lead:-1]))
    a2 = jnp.asarray(a, jnp.float32).reshape(*a.shape[:lead], k, r)
    b2 = jnp.asarray(b, jnp.float32).reshape(*b.shape[:lead], r, -1)
    return (scale * (a2 @ b2)).reshape(w.shape)


def merge(config, params: PyTree) -> dict:
    """The base params with every adapter folded into its kernel (`W + s A B`, in the
    kernel's dtype) and the adapters dropped: what a Hugging Face export holds. The model
    of the merged params is the same one without `lora` (`config.replace(lora=None)`). A
    QLoRA base (`models.quant`) is de-quantised first: `quant.dequantize_base`."""
    scale = config.lora.scale
    out = without_adapters(params)
    for path, node in adapted_kernels(params):
        target = out
        for k in path[:-1]:
            target = target[k]
        w = node["kernel"]
        target[path[-1]] = dict(target[path[-1]], kernel=(jnp.asarray(w, jnp.float32) + delta_weight(node, scale))
                                .astype(w.dtype))
    return out
