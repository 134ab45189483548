"""The toy phase the loop tests run: a 3-weight regression whose trajectory depends on the
data order and the RNG, so that a resumed run equals an uninterrupted one only if both are
restored exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

TX = optax.adam(0.1)
ARRAYS = {"x": np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32)}


def toy_step(state, batch, rng):
    """`(state, {"loss"})` after one Adam step on `mean((x·w − 1)²)` plus RNG noise."""
    noise = jax.random.normal(rng, (3,)) * 0.01

    def loss_fn(p):
        return jnp.mean((batch["x"] @ p["w"] - 1.0) ** 2) + jnp.sum(noise * p["w"])

    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(g, TX), {"loss": loss}
