"""The off-policy correction of a policy-gradient loss whose samples come from another
policy than the one the update starts from: the sampler's own numerics, or an older policy
version when rollout runs ahead of learning (`runs.pipeline`; docs/concepts.md#asynchronous-rl-rollout-ahead-of-learning).

Three policies meet in such a loss (decoupled PPO, Hilton et al. 2022, arXiv:2110.00641;
AReaL, arXiv:2505.24298): the behaviour policy μ that drew the tokens (its log-probs are
the sampler's, `SampleOutput.logprobs`), the proximal policy π_prox the clipped ratio is
measured against (`old_logp`: the trainer's log-probs recomputed at scoring time, or the
update's own first forward pass when the batch is used once), and the policy π_θ being
trained. The clipped ratio `π_θ / π_prox` bounds the step; the importance weight
`w ≈ π_prox / μ` (`ops.importance_weights`, truncated or masked) corrects for μ ≠ π_prox.

`CorrectionConfig.bypass` instead takes μ's log-probs as `old_logp` (verl's bypass mode):
no proximal recompute and no weight; the clip then bounds `π_θ / μ` directly.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxrlhf import ops
from jaxrlhf.options import check, option


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """How a loss corrects for a sampler that is not the proximal policy (each field's doc
    and bounds on the field; the formulas: docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy)."""

    mode: str = option("none", "the importance weight w ≈ π_prox/μ on each token's loss: 'tis' (truncated, min(r, "
                       "cap)), 'mis' (masked, IcePop: r inside [low, high], else 0) or 'none' (w = 1; the mismatch "
                       "metrics are still reported)", choices=ops.IS_MODES)
    level: str = option("token", "the ratio r it is made of: 'token', 'sequence' (the product of the response's "
                        "token ratios) or 'geometric' (their geometric mean)", choices=ops.IS_LEVELS)
    cap: float = option(2.0, "the truncation of mode 'tis'", above=0)
    low: float = option(0.5, "the lower bound of mode 'mis'", min=0)
    high: float = option(5.0, "the upper bound of mode 'mis'", above=0)
    bypass: bool = option(False, "use the sampler's log-probs as old_logp (verl's bypass mode): the scoring program "
                          "skips the proximal forward pass (with num_iterations or num_minibatches > 1) and the clip "
                          "bounds π_θ/μ itself; needs mode 'none'. Sound when sampler = trainer (the parity gate) "
                          "and samples are fresh")

    def __post_init__(self):
        check(self)
        if self.mode == "mis" and not self.low < self.high:
            raise ValueError(f"CorrectionConfig: low must be < high, got low={self.low}, high={self.high}")
        if self.bypass and self.mode != "none":
            raise ValueError(f"CorrectionConfig: bypass=True makes old_logp the sampler's own log-probs, so π_prox "
                             f"= μ and every weight is 1: mode must be 'none', got {self.mode!r}")

    @property
    def weighted(self) -> bool:
        """The loss multiplies each token's term by an importance weight."""
        return self.mode != "none"


def correction(cfg: CorrectionConfig, proximal_logp: jax.Array, behaviour_logp: jax.Array,
               mask: jax.Array) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """`(is_weights or None, metrics)` of a batch: `ops.importance_weights(proximal_logp,
    behaviour_logp, mask, ...)` with `cfg`'s mode, level and bounds; the weights are None
    when `cfg.mode` is "none" (the loss then runs unweighted, the same numbers bit for bit),
    and the metrics (`is_weight_mean`, `is_weight_max`, `is_frac_truncated`,
    `mismatch_kl`, `max_abs_logp_diff`) are reported either way."""
    weights, metrics = ops.importance_weights(proximal_logp, behaviour_logp, mask, mode=cfg.mode, cap=cfg.cap,
                                              low=cfg.low, high=cfg.high, level=cfg.level)
    return (weights if cfg.weighted else None), metrics


__all__ = ["CorrectionConfig", "correction"]
