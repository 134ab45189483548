"""Argument checks shared by the primitives.

Shapes are static under `jit`, so these checks run once at trace time and cost nothing
afterwards. Every message names the function, the argument and the expected shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def _dims(dims: Sequence[str]) -> str:
    return "[" + ", ".join(dims) + "]"


def array(fn: str, name: str, x, dims: Sequence[str]) -> jax.Array:
    """Returns `x` as a real-valued or boolean array of rank `len(dims)`."""
    x = jnp.asarray(x)
    real = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
    if not (real or x.dtype == jnp.bool_):
        raise ValueError(f"{fn}: `{name}` must be a real or boolean array, got dtype {x.dtype}")
    if x.ndim != len(dims):
        raise ValueError(
            f"{fn}: `{name}` must have shape {_dims(dims)} (rank {len(dims)}), "
            f"got shape {x.shape}"
        )
    return x


def float_array(fn: str, name: str, x, dims: Sequence[str]) -> jax.Array:
    """Like `array`, upcast to float32 (bf16 in, float32 math)."""
    return array(fn, name, x, dims).astype(jnp.float32)


def like(
    fn: str, name: str, x, dims: Sequence[str], ref_name: str, shape: tuple[int, ...]
) -> jax.Array:
    """Returns `x` as an array whose shape must equal `shape`, the shape of `ref_name`."""
    x = array(fn, name, x, dims)
    if x.shape != tuple(shape):
        raise ValueError(
            f"{fn}: `{name}` must have shape {_dims(dims)} = {tuple(shape)} like "
            f"`{ref_name}`, got {x.shape}"
        )
    return x


def float_like(
    fn: str, name: str, x, dims: Sequence[str], ref_name: str, shape: tuple[int, ...]
) -> jax.Array:
    return like(fn, name, x, dims, ref_name, shape).astype(jnp.float32)


def mask_like(
    fn: str, x, dims: Sequence[str], ref_name: str, shape: tuple[int, ...]
) -> jax.Array:
    """Returns `mask` as bool: any nonzero entry marks a valid token."""
    return like(fn, "mask", x, dims, ref_name, shape).astype(jnp.bool_)


def choice(fn: str, name: str, value, valid: Sequence[str]) -> str:
    if value not in valid:
        raise ValueError(
            f"{fn}: unknown {name} {value!r}; valid choices are "
            + ", ".join(repr(v) for v in valid)
        )
    return value


def positive(fn: str, name: str, value, *, above: float = 0.0):
    """Checks a hyperparameter when it is a Python number; traced values pass through."""
    if isinstance(value, numbers.Real) and not value > above:
        raise ValueError(f"{fn}: `{name}` must be > {above:g}, got {value}")
    return value
