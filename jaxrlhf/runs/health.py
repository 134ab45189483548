"""Is a train state fit to be saved? Checked after every update, before any checkpoint.

A step's metrics are computed before its update, so their finiteness (the health monitor)
says nothing about the state the step returns: an update at lr=1e38 leaves finite
metrics and weights of 1e38. `UpdateGuard` reads the new state itself, once per step, in
one jitted reduction: every floating leaf of the whole state (parameters, optimizer
state, reference, critic) finite, and the global norm of the trained parameters, whose
change per update must stay under a bound relative to its previous value
(`train.max_param_norm_change`). On a sharded state the reduction is one SPMD program
whose scalar results are the same on every process, so every process of a multi-process
job reaches the same decision at the same step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrlhf.parallel import distributed


class UnhealthyUpdateError(FloatingPointError):
    """An update left a state that must not be saved (not finite, or a blown-up norm).

    Attributes: `phase`, `step`, `reason`.
    """

    def __init__(self, phase: str, step: int, reason: str):
        self.phase, self.step, self.reason = phase, step, reason
        super().__init__(f"{phase} step {step}: {reason}")


@dataclasses.dataclass(frozen=True)
class Health:
    """What `UpdateGuard` reads off a state: `state_finite` (every floating leaf),
    `params_finite` (the trained parameters' leaves) and `param_norm` (their global norm,
    as a Python float: it may exceed float32's range, e.g. 1e40 for weights of 1e38)."""

    state_finite: bool
    params_finite: bool
    param_norm: float


def _floating(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.asarray(True)


def _reduce(state, params) -> dict:
    """The device half of `Health`: the norm as `max|x|` times the norm of `x / max|x|`, so
    that squaring does not overflow float32 for weights beyond 1e19."""
    leaves = _floating(params)
    peak = jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves])) if leaves else 0.0
    scale = jnp.where(jnp.isfinite(peak) & (peak > 0), peak, 1.0)
    sumsq = sum((jnp.sum(jnp.square(x.astype(jnp.float32) / scale)) for x in leaves), jnp.float32(0))
    return dict(state_finite=_all_finite(_floating(state)), params_finite=_all_finite(leaves), peak=peak,
                unit_norm=jnp.sqrt(sumsq))


def make_health_fn(params_of: Callable[[Any], Any]) -> Callable[[Any], Health]:
    """`health(state) -> Health`: one jitted reduction over `state` and `params_of(state)`
    (the trained parameters), read back on every process alike."""
    reduce = jax.jit(lambda state: _reduce(state, params_of(state)))

    def health(state) -> Health:
        out = distributed.gather(reduce(state))
        peak, unit = float(out["peak"]), float(out["unit_norm"])
        norm = peak * unit if math.isfinite(peak) else peak
        return Health(bool(out["state_finite"]), bool(out["params_finite"]), norm)

    return health


class UpdateGuard:
    """Stops a phase at the update that broke its state, before that state is saved.

    `start(state)` reads the state a phase starts (or resumes) from; `check(state, step)`
    the state after each update, raising `UnhealthyUpdateError` when a floating leaf is not
    finite or the trained parameters' global norm changed by more than `max_norm_change`
    times its previous value in one update (None = no bound). The advice names the phase's
    learning rate, `<phase>.optim.lr`: each phase's config section is named after it.
    """

    def __init__(self, phase: str, params_of: Callable[[Any], Any], *, max_norm_change: float | None = None):
        if max_norm_change is not None and not max_norm_change > 0:
            raise ValueError(f"train.max_param_norm_change={max_norm_change}: must be > 0 (None = no bound)")
        self.phase = phase
        self.max_norm_change = max_norm_change
        self._health = make_health_fn(params_of)
        self._norm: float | None = None

    def start(self, state) -> Health:
        """Reads the starting state; its norm is the reference of the first update."""
        health = self._health(state)
        self._norm = health.param_norm
        return health

    def check(self, state, step: int, *, last_saved: int | None = None) -> Health:
        """Raises `UnhealthyUpdateError` unless the state after update `step` is healthy;
        its message says that checkpoint `last_saved` of the phase (None: none) is kept."""
        health = self._health(state)
        problem = self.problem(health)
        if problem is not None:
            reason, advice = problem
            kept = (f"the checkpoint of step {last_saved} ({self.phase}/{last_saved}) is kept" if last_saved
                    else f"no checkpoint of {self.phase} was written")
            raise UnhealthyUpdateError(self.phase, step, f"{reason}: not saved, {kept}; {advice}")
        self._norm = health.param_norm
        return health

    def problem(self, health: Health) -> tuple[str, str] | None:
        """`(reason, advice)` when `health` (the state after an update) must not be saved."""
        lower = f"lower {self.phase}.optim.lr (rerun with --resume_with_changes to resume from the kept checkpoint)"
        if not health.params_finite:
            return f"the parameters are not finite after the update (global norm {health.param_norm:.3g})", lower
        if not health.state_finite:
            return "the optimizer state is not finite after the update (the parameters are)", lower
        before, after = self._norm, health.param_norm
        if self.max_norm_change is not None and before is not None:
            change = abs(after - before) / max(before, 1e-30)
            if not change <= self.max_norm_change:
                return (f"the parameters' global norm went from {before:.4g} to {after:.4g} in one update (a "
                        f"relative change of {change:.3g}, above train.max_param_norm_change="
                        f"{self.max_norm_change:g})",
                        f"{lower}, or raise train.max_param_norm_change (None turns the check off)")
        return None
