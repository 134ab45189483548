"""The Hugging Face tensor ↔ parameter mapping, defined once for loading and saving
(`jaxrlhf.models.hf_checkpoint`). HF `nn.Linear` stores `weight` as `[out, in]`:

| HF tensor | param | conversion |
|---|---|---|
| `model.embed_tokens.weight` `[V, D]` | `embed_tokens/embedding` `[V, D]` | as is |
| `model.layers.i.self_attn.q_proj.weight` `[N*H, D]` | `layers_i/self_attn/q_proj/kernel` `[D, N, H]` | `W.T.reshape` |
| `...k_proj.weight`, `...v_proj.weight` `[K*H, D]` | `.../k_proj/kernel` `[D, K, H]` | `W.T.reshape` |
| `...o_proj.weight` `[D, N*H]` | `.../o_proj/kernel` `[N, H, D]` | `W.T.reshape` |
| `...q_proj.bias` `[N*H]` (k, v: `[K*H]`), `...o_proj.bias` `[D]` | `.../bias` `[N, H]`, `[K, H]`, `[D]` | reshape |
| `...q_norm.weight`, `...k_norm.weight` `[H]` (Qwen3) | `.../q_norm/scale` | as is |
| `...input_layernorm.weight`, `...post_attention_layernorm.weight`, `model.norm.weight` | `.../scale` | as is |
| `...pre_feedforward_layernorm.weight`, `...post_feedforward_layernorm.weight` (Gemma 2/3) | `.../scale` | as is |
| `...mlp.{gate,up}_proj.weight` `[F, D]`, `...mlp.down_proj.weight` `[D, F]` | `.../kernel` `[D, F]`, `[F, D]` | `W.T` |
| `lm_head.weight` `[V, D]` (absent when tied) | `lm_head/kernel` `[D, V]` | `W.T` |
| `score.weight` `[1, D]` (`*ForSequenceClassification`) | `score/kernel` `[D, 1]` | `W.T` |

A scanned stack (`ModelConfig.scan_layers`) keeps the same per-layer mapping: the param
`layers/<rest>` `[n, ...]` is `layers_i/<rest>` of the table stacked over `i`. Loading
stacks the n HF tensors (read slice by slice when sharded); saving writes each layer back
as `model.layers.i.*`, so a saved folder never shows the stacked layout. `stack_layers` /
`unstack_layers` convert a params-shaped pytree between the two layouts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor and the parameter it becomes.

    `in_axes`: for a Linear weight, how many leading axes of our kernel are the input
    (q: `[D | N, H]` → 1, o: `[N, H | D]` → 2); None for tensors copied by reshape only.
    """

    hf_name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]  # ours
    in_axes: int | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.in_axes is None:
            return (int(np.prod(self.shape)),) if self.path[-1] == "bias" else self.shape
        return (int(np.prod(self.shape[self.in_axes:])), int(np.prod(self.shape[:self.in_axes])))

    def from_hf(self, w: np.ndarray) -> np.ndarray:
        if self.in_axes is None:
            return w.reshape(self.shape)
        return np.ascontiguousarray(w.T).reshape(self.shape)

    def read_block(self, hf_slice, index: tuple[slice, ...]) -> np.ndarray:
        """`from_hf(whole)[index]`, reading only the rows/columns of the HF tensor it needs.

        `hf_slice` is a safetensors `get_slice(name)` (anything indexable by a tuple of
        slices). Each HF axis merges a group of our axes (a Linear weight `[out, in]` is
        `[our trailing axes, our leading axes]`); the slice of a group's first axis maps to
        one contiguous HF range, the slices of its other axes are applied after the read.
        """
        nd = len(self.shape)
        index = tuple(index) + (slice(None),) * (nd - len(index))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, self.shape)]
        if self.in_axes is None:
            groups = [list(range(nd))] if len(self.hf_shape) == 1 and nd > 1 else [[i] for i in range(nd)]
        else:
            groups = [list(range(self.in_axes, nd)), list(range(self.in_axes))]
        hf_index, block_shape = [], []
        for g in groups:
            trail = int(np.prod([self.shape[i] for i in g[1:]]))
            start, stop = bounds[g[0]]
            hf_index.append(slice(start * trail, stop * trail))
            block_shape += [stop - start] + [self.shape[i] for i in g[1:]]
        block = np.asarray(hf_slice[tuple(hf_index)]).reshape(block_shape)
        order = [i for g in groups for i in g]
        block = block.transpose(np.argsort(order))
        leads = {g[0] for g in groups}
        rest = tuple(slice(None) if i in leads else slice(*bounds[i]) for i in range(nd))
        return np.ascontiguousarray(block[rest])

    def to_hf(self, p: np.ndarray) -> np.ndarray:
        if self.in_axes is None:
            return np.ascontiguousarray(p.reshape(self.hf_shape))
        n_in = int(np.prod(self.shape[:self.in_axes]))
        return np.ascontiguousarray(p.reshape(n_in, -1).T)


def _trunk_tensors(c: ModelConfig) -> list[_Tensor]:
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    out = [_Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), (c.vocab_size, d))]
    for i in range(c.num_layers):
        hf, us = f"model.layers.{i}.", f"layers_{i}"
        attn = [("q_proj", (d, n, h), 1, (n, h) if c.qkv_bias else None),
                ("k_proj", (d, k, h), 1, (k, h) if c.qkv_bias else None),
                ("v_proj", (d, k, h), 1, (k, h) if c.qkv_bias else None),
                ("o_proj", (n, h, d), 2, (d,) if c.o_bias else None)]
        for name, shape, in_axes, bias in attn:
            out.append(_Tensor(f"{hf}self_attn.{name}.weight", (us, "self_attn", name, "kernel"), shape, in_axes))
            if bias is not None:
                out.append(_Tensor(f"{hf}self_attn.{name}.bias", (us, "self_attn", name, "bias"), bias))
        if c.qk_norm:
            for name in ("q_norm", "k_norm"):
                out.append(_Tensor(f"{hf}self_attn.{name}.weight", (us, "self_attn", name, "scale"), (h,)))
        norms = ("input_layernorm", "post_attention_layernorm") + (
            ("pre_feedforward_layernorm", "post_feedforward_layernorm") if c.sandwich_norms else ())
        for name in norms:
            out.append(_Tensor(f"{hf}{name}.weight", (us, name, "scale"), (d,)))
        for name, shape in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
            out.append(_Tensor(f"{hf}mlp.{name}.weight", (us, "mlp", name, "kernel"), shape, 1))
            if c.mlp_bias:
                out.append(_Tensor(f"{hf}mlp.{name}.bias", (us, "mlp", name, "bias"), shape[-1:]))
    out.append(_Tensor("model.norm.weight", ("norm", "scale"), (d,)))
    return out


_LAYER_PATH = re.compile(r"layers_(\d+)")


@dataclasses.dataclass(frozen=True)
class _Param:
    """One parameter and the HF tensors it is read from: a single tensor, or (scanned stack)
    the same tensor of every layer, stacked on a new leading axis."""

    path: tuple[str, ...]
    tensors: tuple[_Tensor, ...]
    stacked: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return ((len(self.tensors),) if self.stacked else ()) + self.tensors[0].shape

    def read(self, files: Mapping[str, Any], index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The param (`index=None`) or its block `index`, from open safetensors `files`
        (HF name → `safe_open` handle); a block reads only its slices of the HF tensors."""
        if index is None:
            ws = [t.from_hf(files[t.hf_name].get_tensor(t.hf_name)) for t in self.tensors]
        else:
            rest = index[1:] if self.stacked else index
            layers = range(*index[0].indices(len(self.tensors))) if self.stacked else [0]
            ws = [self.tensors[i].read_block(files[self.tensors[i].hf_name].get_slice(self.tensors[i].hf_name), rest)
                  for i in layers]
        return np.stack(ws) if self.stacked else ws[0]


def _params_of(c: ModelConfig, tensors: list[_Tensor]) -> list[_Param]:
    """The params that `tensors` make: one each, or with `c.scan_layers` one per layer
    tensor kind (`layers/<rest>`, stacked over `layers_i/<rest>` in layer order)."""
    out, stacks = [], {}
    for t in tensors:
        m = _LAYER_PATH.fullmatch(t.path[0]) if c.scan_layers else None
        if m is None:
            out.append(_Param(t.path, (t,), False))
        else:
            stacks.setdefault(("layers",) + t.path[1:], {})[int(m.group(1))] = t
    for path, by_layer in stacks.items():
        out.append(_Param(path, tuple(by_layer[i] for i in range(c.num_layers)), True))
    return out


class _LayerOf(NamedTuple):
    """Layer `i` of a stacked `[n, ...]` param, sliced only when its shard is written."""

    stacked: Any
    i: int

    @property
    def shape(self):
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        return self.stacked.dtype

    def get(self):
        return self.stacked[self.i]


def _param_of(params: Mapping, t: _Tensor, c: ModelConfig):
    """The value of HF tensor `t` in `params`: the param itself, or a `_LayerOf` the stacked
    `layers/<rest>` param of a scanned stack."""
    m = _LAYER_PATH.fullmatch(t.path[0]) if c.scan_layers else None
    path = t.path if m is None else ("layers",) + t.path[1:]
    try:
        p = _get(params, path)
    except KeyError:
        raise KeyError(f"params lack {'/'.join(path)} (HF tensor {t.hf_name!r})") from None
    if m is None:
        return p
    if p.shape[0] != c.num_layers:
        raise ValueError(f"params {'/'.join(path)} has shape {tuple(p.shape)}, expected {c.num_layers} layers "
                         "on axis 0")
    return _LayerOf(p, int(m.group(1)))


def _head_tensors(c: ModelConfig, head: str) -> list[_Tensor]:
    """The head's parameters; `value_head` has no HF counterpart (its name is a placeholder)."""
    d = c.hidden_size
    lm = [] if c.tie_word_embeddings else [_Tensor("lm_head.weight", ("lm_head", "kernel"), (d, c.vocab_size), 1)]
    if head == "lm":
        return lm
    if head == "score":
        return [_Tensor("score.weight", ("score", "kernel"), (d, 1), 1)]
    return lm + [_Tensor("value_head.weight", ("value_head", "kernel"), (d, 1), 1)]


def hf_tensor_map(config: ModelConfig, head: str = "lm") -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """HF tensor name → (param path, HF shape) for a model with `head` (no `value_head`).

    The paths are the unrolled layout's (`layers_i/...`); a scanned stack holds layer `i`
    of `layers/...` (see the module docstring)."""
    tensors = _trunk_tensors(config) + _head_tensors(config, head)
    return {t.hf_name: (t.path, t.hf_shape) for t in tensors if t.path[0] != "value_head"}


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


_LAYER_KEY = re.compile(r"layers_(\d+)")


def stack_layers(params):
    """Unrolled params (`layers_0 .. layers_{n-1}`) → the scanned layout: one `layers`
    subtree whose leaves are the layers' stacked on a new leading axis. Other entries (the
    embedding, final norm, heads) are kept. Works on any pytree shaped like the params
    (gradients, numpy or jax leaves)."""
    index = {int(m.group(1)): k for k in params if (m := _LAYER_KEY.fullmatch(k))}
    if not index or sorted(index) != list(range(len(index))):
        raise ValueError(f"expected layers_0 .. layers_{{n-1}} in the params, got {sorted(params)}")
    stack = lambda *xs: np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    out = {k: v for k, v in params.items() if k not in index.values()}
    out["layers"] = jax.tree.map(stack, *[params[index[i]] for i in range(len(index))])
    return out


def unstack_layers(params):
    """The scanned layout (`layers`, leaves `[n, ...]`) → unrolled `layers_0 .. layers_{n-1}`."""
    if "layers" not in params:
        raise ValueError(f"expected a stacked `layers` subtree in the params, got {sorted(params)}")
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(n):
        out[f"layers_{i}"] = jax.tree.map(lambda a: a[i], params["layers"])
    return out
