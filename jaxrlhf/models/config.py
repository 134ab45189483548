"""`ModelConfig`: the decoder hyperparameters, and their translation to and from Hugging Face.

One frozen dataclass describes every supported family (Llama 2/3, Qwen2/2.5, Qwen3,
Mistral, Gemma, Gemma 2, Gemma 3 text): the families differ only in switches (q/k/v bias,
q/k RMSNorm, rope scaling, tied embeddings, sliding-window layers, Gemma's `x·(1+w)` norms,
GeGLU, scaled embeddings, sandwich norms and soft-capping; docs/models.md has the table).
Anything in a checkpoint's `config.json` that this decoder does not implement
is refused with a message naming the field, never approximated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from jaxrlhf.models.attention import IMPLEMENTATIONS
from jaxrlhf.models.lora import LoraConfig
from jaxrlhf.models.quant import check_kind

# model_type -> the switches that distinguish the family (None: read from config.json).
_GEMMA = dict(qkv_bias=None, qk_norm=False, norm_plus_one=True, scale_embeddings=True)
_FAMILIES = {
    "llama": dict(qkv_bias=None, qk_norm=False),  # qkv_bias from `attention_bias`
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=None, qk_norm=True),
    "mistral": dict(qkv_bias=False, qk_norm=False),  # + a sliding window on every layer
    "gemma": _GEMMA,
    "gemma2": dict(_GEMMA, sandwich_norms=True),  # + soft-capping, local/global layers
    "gemma3_text": dict(_GEMMA, qk_norm=True, sandwich_norms=True),  # + a local rope base
}
# model_type -> the transformers class prefix; `*ForSequenceClassification` of gemma3_text is
# Gemma3TextForSequenceClassification (Gemma3ForSequenceClassification is the multimodal one).
_ARCH_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma": "Gemma",
                "gemma2": "Gemma2", "gemma3_text": "Gemma3"}
# Biases on q/k/v *and* o_proj from `attention_bias`.
_O_BIAS_FAMILIES = ("llama", "gemma", "gemma2", "gemma3_text")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = ("float32", "bfloat16", "float16")
# How the model runs, not what it is: set by the user, never read from or written to a
# checkpoint's config.json (`load_pretrained(path, **options)`, `config.model.<field>`).
RUNTIME_FIELDS = ("remat", "attention", "cache_dtype", "matmul_dtype", "scan_layers", "logprobs_head")
# `ModelConfig.remat`: what each decoder layer keeps for the backward pass.
#   "none": everything (no rematerialisation);
#   "full": only its input (`jax.checkpoint`, nothing saveable): the layer is recomputed;
#   "dots": the outputs of its weight matmuls (`dots_with_no_batch_dims_saveable`);
#     the attention scores and the elementwise ops are recomputed;
#   "offload": those matmul outputs, moved to pinned host memory
#     (`offload_dot_with_no_batch_dims("device", "pinned_host")`).
# The booleans of earlier versions are accepted: True -> "full", False -> "none".
REMAT_POLICIES = ("none", "full", "dots", "offload")
# How the trainer's log-probs meet the LM head (`jaxrlhf.algorithms.common.head_logprobs`):
# "plain" projects the [B, T, V] logits, "chunked" fuses the head into `ops.linear_logprobs`
# (no [B, T, V] array), "auto" picks by size.
LOGPROBS_HEADS = ("auto", "plain", "chunked")


class UnsupportedConfigError(ValueError):
    """A checkpoint config asks for something this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (`rope_type` "linear" or "llama3")."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer (pre-norm, RoPE, GQA, SwiGLU).

    `dtype` is the compute dtype, `param_dtype` the storage dtype of parameters,
    `cache_dtype` the sampler's KV cache dtype (default: `dtype`; bf16 with float32 params
    halves the cache); RMSNorm, softmax and rotary angles are always computed in float32.
    `matmul_dtype` (default: `dtype`) is the input dtype of the decoder layers' projection
    dots, which accumulate in float32 and return `dtype`: "bfloat16" with bf16 params and
    float32 compute multiplies by the kernels as stored (no per-call conversion to float32;
    on an AVX-512 CPU `generate` at the SmolLM2-135M shape, B = 64, 1.47x faster than
    float32 — docs/benchmarks.md, "Decode-step dots on XLA:CPU").
    `attention` picks the attention implementation (`jaxrlhf.models.attention`).
    `remat` names a rematerialisation policy of each layer (`REMAT_POLICIES`; True/False
    read as "full"/"none"). `scan_layers` runs the layer stack as one `jax.lax.scan` over
    parameters stacked on a leading `[num_layers]` axis (the subtree `layers`, logical
    axis "layers"), so compile time does not grow with depth; False (the default) unrolls
    `layers_0 .. layers_{n-1}`, which decodes faster on CPU.
    `logprobs_head` how training and scoring passes take log-probs from the LM head
    (`LOGPROBS_HEADS`). `lora` puts low-rank adapters on the projections it targets
    (`jaxrlhf.models.lora`; params without adapters still run, as the base model).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama `attention_bias` (which also biases o_proj)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU, or GeGLU "gelu_pytorch_tanh" (Gemma)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), its weights stored around 0
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the compute dtype
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: scores scaled by its -1/2, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores c·tanh(s/c)
    final_logit_softcapping: float | None = None  # Gemma 2: logits c·tanh(z/c)
    sliding_window: int | None = None  # the local layers' window (Mistral, Gemma 2/3)
    # Per layer "full_attention" or "sliding_attention"; None: every layer sliding when
    # `sliding_window` is set (Mistral), else full.
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling); None: global's
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"  # a name in REMAT_POLICIES (True/False accepted: "full"/"none")
    scan_layers: bool = False
    attention: str = "auto"  # a name in `jaxrlhf.models.attention.IMPLEMENTATIONS`
    cache_dtype: str | None = None  # the KV cache's dtype; None: `dtype`
    matmul_dtype: str | None = None  # the layers' projection dots' input dtype; None: `dtype`
    logprobs_head: str = "auto"  # a name in LOGPROBS_HEADS
    lora: LoraConfig | None = None  # adapters on the projections it targets (`jaxrlhf.models.lora`)
    quantize: str = "none"  # QLoRA: layer projection kernels stored "int8" / "nf4" (`jaxrlhf.models.quant`)

    def __post_init__(self):
        if isinstance(self.remat, (bool, np.bool_)):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; expected one of {list(REMAT_POLICIES)} "
                             "(or True/False for 'full'/'none')")
        if not isinstance(self.scan_layers, (bool, np.bool_)):
            raise ValueError(f"scan_layers={self.scan_layers!r}; expected True or False")
        check_kind(self.quantize, field="quantize")
        if self.model_type not in _FAMILIES:
            raise UnsupportedConfigError(
                f"model_type={self.model_type!r} is not supported; expected one of "
                f"{sorted(_FAMILIES)}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedConfigError(f"hidden_act={self.hidden_act!r}; expected one of {list(_ACTIVATIONS)}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise UnsupportedConfigError(
                    f"layer_types={list(self.layer_types)}; expected {self.num_layers} entries from {list(LAYER_TYPES)}")
        if self.sliding_window is None and any(self.local_layers()):
            raise UnsupportedConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling.rope_type not in _ROPE_TYPES:
            raise UnsupportedConfigError(
                f"rope_type={self.rope_scaling.rope_type!r} is not implemented; supported: "
                f"{list(_ROPE_TYPES)}"
            )
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}; expected one of {list(IMPLEMENTATIONS)}")
        if self.logprobs_head not in LOGPROBS_HEADS:
            raise ValueError(f"logprobs_head={self.logprobs_head!r}; expected one of {list(LOGPROBS_HEADS)}")
        optional = tuple(name for name in ("cache_dtype", "matmul_dtype") if getattr(self, name) is not None)
        for name in ("dtype", "param_dtype") + optional:
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {list(_DTYPES)}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends within `sliding_window` only (a local layer)."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def attention_scale(self) -> float:
        """The score scale: `query_pre_attn_scalar ** -0.5` (Gemma 2/3), else `head_dim ** -0.5`."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_params(self) -> int:
        """Parameter count of the causal LM (embeddings, trunk, and the LM head if untied)."""
        d, f, h, k, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                          self.num_kv_heads, self.head_dim)
        attn = d * hd * (2 * h + 2 * k) + (hd * (h + 2 * k) if self.qkv_bias else 0)
        attn += (d if self.o_bias else 0) + (2 * hd if self.qk_norm else 0)
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        layer = attn + mlp + (4 * d if self.sandwich_norms else 2 * d)
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """Rotary inverse frequencies `[head_dim // 2]` in float64, scaling applied; `local`:
        a sliding layer's (base `local_rope_theta` unscaled, when set: Gemma 3)."""
        dim = self.head_dim
        if local and self.local_rope_theta is not None:
            return 1.0 / (self.local_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        rs = self.rope_scaling
        if rs.rope_type == "linear":
            return inv / rs.factor
        if rs.rope_type == "llama3":
            # Llama 3.1 "frequency-dependent" scaling: long wavelengths are divided by
            # `factor`, short ones kept, the band in between interpolated smoothly.
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled)
        return inv


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    # transformers >= 5 folds rope_theta into `rope_parameters`; older files use
    # `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedConfigError(
            f"config.json: rope_type={rope_type!r} is not implemented (supported: "
            f"{list(_ROPE_TYPES)}); refusing to approximate it"
        )
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    extra = {k: v for k, v in params.items()
             if k not in known and v is not None
             and not (k == "partial_rotary_factor" and v == 1)}
    if extra:
        raise UnsupportedConfigError(f"config.json: unsupported rope fields {sorted(extra)}")
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def check_model_type(model_type: Any) -> None:
    """Refuse a `model_type` outside `_FAMILIES`, naming the field (and, for Gemma 3's
    multimodal checkpoints, the text model that is supported)."""
    if model_type in _FAMILIES:
        return
    hint = (" (Gemma3ForConditionalGeneration, the multimodal model; its text-only checkpoints, "
            "model_type 'gemma3_text', are supported)" if model_type == "gemma3" else "")
    raise UnsupportedConfigError(f"config.json: model_type={model_type!r} is not supported{hint}; supported "
                                 f"families: {sorted(_FAMILIES)}")


def hf_architecture(model_type: str, suffix: str) -> str:
    """The transformers class for `model_type` and `suffix` ("ForCausalLM" or "ForSequenceClassification")."""
    if model_type == "gemma3_text" and suffix == "ForSequenceClassification":
        return "Gemma3TextForSequenceClassification"
    return _ARCH_PREFIX[model_type] + suffix


def _gemma3_rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling, float]:
    """Gemma 3's two rotary embeddings: `(theta, scaling)` of the global layers and the local
    layers' base, from `rope_parameters` keyed by layer type (transformers >= 5) or the older
    `rope_theta` + `rope_scaling` + `rope_local_base_freq`."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedConfigError(f"config.json: rope_parameters.sliding_attention.rope_type="
                                         f"{local['rope_type']!r}; only 'default' is implemented for local layers")
        theta, scaling = _rope_from_hf({"rope_parameters": {"rope_theta": 1_000_000.0,
                                                            **(params.get("full_attention") or {})}})
        return theta, scaling, float(local.get("rope_theta", 10_000.0))
    theta, scaling = _rope_from_hf({"rope_theta": 1_000_000.0, **hf})
    return theta, scaling, float(hf.get("rope_local_base_freq", 10_000.0))


def _layer_types_from_hf(hf: Mapping[str, Any], model_type: str) -> tuple[str, ...] | None:
    """Gemma 2/3's per-layer attention kinds: `layer_types`, else the `sliding_window_pattern`
    (every n-th layer global; Gemma 2: every second)."""
    if model_type not in ("gemma2", "gemma3_text"):
        return None
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    every = hf.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6)
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"]))


def from_hf_config(hf: Any, **overrides) -> ModelConfig:
    """Build a `ModelConfig` from a transformers config object or its `to_dict()`."""
    if not isinstance(hf, Mapping):
        hf = hf.to_dict()
    model_type = hf.get("model_type")
    check_model_type(model_type)
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if model_type.startswith("gemma") and act == "gelu":  # Gemma's legacy "gelu" is read as the tanh form
        act = "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"config.json: hidden_act={act!r}; implemented: {list(_ACTIVATIONS)}")
    if hf.get("use_sliding_window"):
        raise UnsupportedConfigError("config.json: use_sliding_window=true is not implemented")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedConfigError("config.json: use_bidirectional_attention=true is not implemented "
                                     "(a causal decoder only)")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedConfigError("config.json: pretraining_tp != 1 is not implemented")
    local_theta = None
    if model_type == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope_from_hf(hf)
    else:
        theta, scaling = _rope_from_hf(hf)
    family = _FAMILIES[model_type]
    attention_bias = bool(hf.get("attention_bias", False))
    gemma2 = model_type in ("gemma2", "gemma3_text")
    window = hf.get("sliding_window") if model_type in ("mistral", "gemma2", "gemma3_text") else None
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    eos = hf.get("eos_token_id")
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        model_type=model_type,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if family["qkv_bias"] is None else family["qkv_bias"],
        o_bias=attention_bias if model_type in _O_BIAS_FAMILIES else False,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family["qk_norm"],
        hidden_act=act,
        norm_plus_one=family.get("norm_plus_one", False),
        scale_embeddings=family.get("scale_embeddings", False),
        sandwich_norms=family.get("sandwich_norms", False),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma2 else None,
        attn_logit_softcapping=hf.get("attn_logit_softcapping") if gemma2 else None,
        final_logit_softcapping=hf.get("final_logit_softcapping") if gemma2 else None,
        sliding_window=window,
        layer_types=_layer_types_from_hf(hf, model_type),
        local_rope_theta=local_theta,
        pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else eos,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def to_hf_dict(config: ModelConfig, *, architecture: str = "ForCausalLM", num_labels: int | None = None) -> dict:
    """The `config.json` contents that transformers loads into the same model.

    `architecture` is the class suffix: "ForCausalLM" or "ForSequenceClassification".
    """
    rope = {"rope_type": config.rope_scaling.rope_type, "rope_theta": config.rope_theta}
    if config.rope_scaling.rope_type != "default":
        rope.update(factor=config.rope_scaling.factor)
    if config.rope_scaling.rope_type == "llama3":
        rs = config.rope_scaling
        rope.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
    out = {
        "architectures": [hf_architecture(config.model_type, architecture)],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id,
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    if config.rope_scaling.rope_type != "default":
        out["rope_scaling"] = dict(rope)
    if config.model_type in _O_BIAS_FAMILIES:
        if config.qkv_bias != config.o_bias:
            raise UnsupportedConfigError(f"{config.model_type} checkpoints bias q/k/v and o_proj together")
        out.update(attention_bias=config.qkv_bias)
    if config.model_type == "llama":
        out.update(mlp_bias=config.mlp_bias)
    elif config.model_type == "qwen3":
        out.update(attention_bias=config.qkv_bias)
    if config.model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if config.model_type in ("mistral", "gemma2", "gemma3_text"):
        out.update(sliding_window=config.sliding_window)
    if config.model_type in ("gemma2", "gemma3_text"):
        out.update(hidden_activation=out.pop("hidden_act"), layer_types=list(config.layer_types or
                                                                          ["full_attention"] * config.num_layers),
                   query_pre_attn_scalar=config.query_pre_attn_scalar,
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
    if config.model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        out.pop("rope_theta")
        out.pop("rope_scaling", None)
    if num_labels is not None:
        out["num_labels"] = num_labels
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    return out
