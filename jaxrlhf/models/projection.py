"""`Projection`: the decoder's linear maps (attention, MLP, an untied LM head), their init
and their LoRA adapter hook (`models.lora`), as one 2-D matmul on merged axes."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import quant
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraConfig

_init = nn.initializers.normal(stddev=0.02)


def _rows_matmul(x_NxK: jax.Array, w_KxM: jax.Array, accumulate=None) -> jax.Array:
    """`[..., K] @ [K, M] -> [..., M]` as one 2-D matmul over the flattened leading axes
    (`accumulate`: the dot's `preferred_element_type`, e.g. float32 for bf16 inputs).

    With [B, L] leading axes the weight gradient contracts two axes, which XLA:CPU sends to
    a slower transposing GEMM; flattened, it is one contraction (train step 0.24 -> 0.20 s).
    """
    lead = x_NxK.shape[:-1]
    y = jnp.matmul(x_NxK.reshape(-1, x_NxK.shape[-1]), w_KxM, preferred_element_type=accumulate)
    return y.reshape(*lead, w_KxM.shape[-1])


class Projection(nn.Module):
    """A linear map whose kernel has named axes, `shape = in_shape + out_shape`.

    The input's trailing `len(shape) - n_out` axes are contracted with the kernel's leading
    ones (`BLD,DNH->BLNH`, `BLNH,NHD->BLD`), computed as one 2-D matmul on merged axes:
    a multi-axis einsum let XLA:CPU transpose the kernel on every decode step.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    bias_axes: tuple[str | None, ...] | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    n_out: int | None = None  # number of output axes; default: all but the first
    lora: LoraConfig | None = None  # this projection's adapter, when the model's LoRA targets it
    quantize: str = "none"  # QLoRA: the kernel may be stored quantised (`models.quant`)
    matmul_dtype: jnp.dtype | None = None  # the dot's input dtype, float32 accumulation; None: `dtype`

    @nn.compact
    def __call__(self, x):
        n_out = len(self.shape) - 1 if self.n_out is None else self.n_out
        n_in = len(self.shape) - n_out
        in_shape, out_shape = self.shape[:n_in], self.shape[n_in:]
        if tuple(x.shape[-n_in:]) != tuple(in_shape):
            raise ValueError(f"{self.name}: input trailing shape {x.shape[-n_in:]} != kernel {in_shape}")
        lead = x.shape[:-n_in]
        k = int(np.prod(in_shape))
        x_NxK = x.astype(self.dtype).reshape(*lead, k)
        if self.matmul_dtype is None:
            y = _rows_matmul(x_NxK, self._kernel_KxM(k, n_in))
        else:  # `ModelConfig.matmul_dtype`: e.g. bf16 x bf16 kernel -> float32, back to `dtype`
            y = _rows_matmul(x_NxK.astype(self.matmul_dtype), self._kernel_KxM(k, n_in),
                             jnp.float32).astype(self.dtype)
        # LoRA (`models.lora`): + s·(x A) B, only where the params hold the adapter (the
        # same params without it are the base model). B = 0 adds exactly 0. Adapter
        # dropout drops x on this path only, the base path above never sees it.
        if self.lora is not None and (self.is_initializing() or self.has_variable("params", "lora_a")):
            r = self.lora.rank
            a = self.param("lora_a", nn.with_logical_partitioning(lora_lib.init_a, self.axes[:n_in] + (None,)),
                           (*in_shape, r), jnp.float32)
            b = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros, (None,) + self.axes[n_in:]),
                           (r, *out_shape), jnp.float32)
            x_NxR = _rows_matmul(self._adapter_input(x_NxK), a.astype(self.dtype).reshape(k, r))
            y = y + self.lora.scale * _rows_matmul(x_NxR, b.astype(self.dtype).reshape(r, -1))
        y = y.reshape(*lead, *out_shape)
        if self.bias_axes is not None:
            b = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                           self.shape[-len(self.bias_axes):], self.param_dtype)
            y = y + b.astype(self.dtype)
        return y

    def _adapter_input(self, x_NxK: jax.Array) -> jax.Array:
        """The adapter's input: `x`, or with `lora.dropout = p > 0` and a "dropout" rng
        (`model.apply(..., rngs={"dropout": key})`, training losses only) `x` with each
        element dropped with probability p and the kept ones scaled by `1 / (1 − p)`
        (inverted dropout, as PEFT's `lora_dropout`: the expected adapter term is unchanged)."""
        p = self.lora.dropout
        if p == 0 or not self.has_rng("dropout"):
            return x_NxK
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - p, x_NxK.shape)
        return jnp.where(keep, x_NxK / jnp.asarray(1.0 - p, x_NxK.dtype), jnp.zeros((), x_NxK.dtype))

    def _kernel_KxM(self, k: int, n_in: int) -> jax.Array:
        """The kernel as the `[K, M]` matrix the input multiplies, in the dot's input dtype
        (`matmul_dtype`, else the compute dtype): the float param, or (QLoRA, `quantize` set
        and the params hold codes) de-quantised here, inside the jit, so no float copy of
        the base is ever stored."""
        dt = self.dtype if self.matmul_dtype is None else self.matmul_dtype
        if self.quantize != "none" and (self.is_initializing() or quant.is_quantized(
                self.get_variable("params", "kernel"))):
            q = self.param("kernel", quant.kernel_init(_init, self.quantize, self.axes, n_in), self.shape,
                           self.param_dtype)
            return quant.dequantize(q, dt)
        w = self.param("kernel", nn.with_logical_partitioning(_init, self.axes), self.shape, self.param_dtype)
        return w.astype(dt).reshape(k, -1)


def _adapter(config: ModelConfig, path: str) -> LoraConfig | None:
    """The projection at `path` ("self_attn/q_proj", "lm_head")'s adapter config, if any."""
    return config.lora if config.lora is not None and config.lora.adapts(path) else None


def _matmul_dtype(config: ModelConfig) -> jnp.dtype | None:
    """The decoder layers' projection dot input dtype (`ModelConfig.matmul_dtype`), or None."""
    return None if config.matmul_dtype is None else jnp.dtype(config.matmul_dtype)
