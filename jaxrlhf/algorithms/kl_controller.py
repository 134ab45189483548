"""The KL coefficient β of RLHF-PPO: fixed, or adapted toward a target KL.

Adaptive control follows Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", arXiv:1909.08593, §2.2), a proportional controller in log-space:

    e = clip(KL / KL_target − 1, −0.2, 0.2)
    β ← β · (1 + e · n_steps / horizon)

where `KL` is the measured KL(π‖ref) of the batch just sampled (summed over the tokens of a
response, averaged over responses, in nats) and `n_steps` the number of samples it covers
(TRL's `AdaptiveKLController.update(current, n_steps)` convention: the batch size).
β rises while the measured KL is above target and falls while it is below.

The state is a pytree and `update` a pure function, so both live inside a jitted step.

    cfg = KLControllerConfig(init_beta=0.05, target=6.0, horizon=10_000)
    ctl = init(cfg)
    ctl = update(ctl, measured_kl, n_steps=batch_size, cfg=cfg)
    rewards = ops.shape_rewards(scores, kl, mask, ctl.beta)
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

ERROR_CLIP = 0.2  # Ziegler et al. clip the proportional error to ±0.2


@dataclasses.dataclass(frozen=True)
class KLControllerConfig:
    """`target=None`: β stays `init_beta` (fixed). Otherwise adaptive, see module docstring.

    init_beta: starting β ≥ 0 (Ziegler et al.: 0.1 for stylistic tasks; TRL's PPO: 0.05).
    target: target KL in nats per response (Ziegler et al.: 6.0 for descriptiveness).
    horizon: how many samples it takes to close the error (Ziegler et al.: 10 000).
    """

    init_beta: float = 0.05
    target: float | None = None
    horizon: int = 10_000

    def __post_init__(self):
        if not self.init_beta >= 0:
            raise ValueError(f"KL controller: init_beta must be >= 0, got {self.init_beta}")
        if self.target is not None and not self.target > 0:
            raise ValueError(f"KL controller: target must be > 0 (or None for a fixed β), got {self.target}")
        if not self.horizon > 0:
            raise ValueError(f"KL controller: horizon must be > 0, got {self.horizon}")

    @property
    def adaptive(self) -> bool:
        return self.target is not None


@flax.struct.dataclass
class KLControllerState:
    """`beta`: the current coefficient, a float32 scalar."""

    beta: jax.Array


def init(cfg: KLControllerConfig) -> KLControllerState:
    return KLControllerState(beta=jnp.asarray(cfg.init_beta, jnp.float32))


def proportional_error(kl: jax.Array, target: float) -> jax.Array:
    """`clip(kl / target − 1, −0.2, 0.2)`."""
    return jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -ERROR_CLIP, ERROR_CLIP)


def update(state: KLControllerState, kl: jax.Array, n_steps: int | jax.Array, *,
           cfg: KLControllerConfig) -> KLControllerState:
    """One controller step after a batch whose measured KL (nats per response) is `kl`.

    Fixed β (`cfg.target is None`): returns `state` unchanged. A non-finite `kl` leaves β
    unchanged too (a NaN must not poison every later reward).
    """
    if not cfg.adaptive:
        return state
    error = proportional_error(kl, cfg.target)
    beta = state.beta * (1.0 + error * jnp.asarray(n_steps, jnp.float32) / cfg.horizon)
    return state.replace(beta=jnp.where(jnp.isfinite(beta), beta, state.beta))
