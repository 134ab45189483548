"""The GRPO family's options: `GRPOConfig` (validated on construction) and the named
variants of `preset` (GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++); the algorithm itself
is `algorithms.grpo`, which re-exports both."""

from __future__ import annotations

import dataclasses

from jaxrlhf import ops
from jaxrlhf.algorithms import kl_controller, kl_terms
from jaxrlhf.algorithms.experience import SamplingConfig

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
RATIO_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Every option of the GRPO family (validated on construction).

    Attributes:
      sampling: how responses are drawn; `sampling.num_samples` is the group size G.
      advantage: "grpo" | "dr_grpo" | "rloo" | "reinforce_pp" (see the module docstring).
      adv_eps: ε of "grpo" advantages `(s − mean)/(std + ε)` (TRL uses 1e-4).
      beta: coefficient of `agg(KL)` in the loss; 0 needs no reference model.
      track_kl: with β = 0, still keep the reference model and report `kl` (the masked
        mean of the estimator against it) without putting it in the loss: the health
        monitor's drift check then works for unregularised runs too (one more forward
        pass per step).
      kl_estimator: "k3" (the GRPO choice), or "k1" / "k2"
        (docs/concepts.md#kl-to-the-reference-in-the-reward-or-in-the-loss).
      kl_in: "loss" (`β·agg(kl)` in the loss, `kl_terms.loss_term`) or "reward" (each
        score less `β·Σ_t kl_t` before the advantages, `kl_terms.sequence_reward`).
      kl_target: None for a fixed β; else the target KL (nats per response, the rollout
        policy's `Σ_t kl_t` averaged over responses) of the adaptive controller, which then
        starts at `beta` (`kl_controller`; needs beta > 0). kl_horizon: its horizon in samples.
      clip_low, clip_high: ε_low, ε_high of the clipped ratio (clip_high None = clip_low;
        DAPO's clip-higher is clip_high > clip_low).
      dual_clip: c > 1 bounds the loss of negative-advantage tokens (None: off).
      agg: loss aggregation, one of `ops.aggregate`'s four modes.
      norm_len: L of "seq-mean-token-sum-norm"; None means `sampling.max_new_tokens`.
      entropy_coef: c_ent of the entropy bonus `− c_ent·agg(entropy)`.
      num_iterations: μ, passes over each rollout batch (μ > 1 reuses the rollout's old
        log-probs, so the ratio moves away from 1 after the first minibatch).
      num_minibatches: optimizer steps per pass (shuffled minibatches).
      num_microbatches: gradient-accumulation chunks per minibatch (same result as one
        chunk: `common.accumulation_scale` keeps the normalisation).
      ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO).
      dynamic_sampling: zero the advantages of groups whose scores are all equal and, with
        `prompts_per_step`, keep only groups with signal from an oversampled prompt pool.
      prompts_per_step: groups in the update batch under dynamic sampling (the iteration is
        then given a pool of at least this many prompts); None keeps every prompt.
      overlong_max_len, overlong_cache: DAPO's soft overlong penalty in tokens
        (`overlong_penalty`); None turns it off.
      overlong_coef: weight of that penalty, added to the score before advantages.
      share_prompt: run each group's prompt once in the scoring and training forward
        passes, its G responses on the prompt's keys and values (`common.response_hidden`
        with `group_size=G`): the same numbers up to float rounding, `(P + T)·G → P + T·G`
        tokens through the layers. Used wherever rows stay in whole groups: always for the
        rollout's scoring, and in the update when `num_minibatches == 1` (a shuffled
        minibatch mixes groups) and G divides each micro-batch.
      guide_coef: c > 0 adds `c·` the token-mean NLL of the prompt's reference completion
        for every prompt whose group's best score is below `guide_below` (`algorithms.guide`:
        supervised guidance on the prompts RL gets no signal from, as in ReLIFT / SRFT); the
        iteration's extras must then hold `guide.GUIDE_KEYS`. 0: off (no reference needed).
      guide_below: the threshold on a group's best score (the reward's total, before any
        shaping) under which its prompt counts as failed.
    """

    sampling: SamplingConfig
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    beta: float = 0.0
    track_kl: bool = False
    kl_estimator: str = "k3"
    kl_in: str = "loss"
    kl_target: float | None = None
    kl_horizon: int = 10_000
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    agg: str = "token-mean"
    norm_len: int | None = None
    entropy_coef: float = 0.0
    num_iterations: int = 1
    num_minibatches: int = 1
    num_microbatches: int = 1
    ratio_level: str = "token"
    dynamic_sampling: bool = False
    prompts_per_step: int | None = None
    overlong_max_len: int | None = None
    overlong_cache: int = 0
    overlong_coef: float = 1.0
    share_prompt: bool = True
    guide_coef: float = 0.0
    guide_below: float = 1.0

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"GRPOConfig: {msg}")

        if not isinstance(self.sampling, SamplingConfig):
            fail(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        for name, allowed in (("advantage", ADVANTAGES), ("ratio_level", RATIO_LEVELS),
                              ("kl_estimator", ops.KL_ESTIMATORS), ("agg", ops.AGGREGATE_MODES),
                              ("kl_in", kl_terms.KL_PLACEMENTS)):
            if getattr(self, name) not in allowed:
                fail(f"{name}={getattr(self, name)!r}; expected one of {allowed}")
        g = self.sampling.num_samples
        if self.advantage != "reinforce_pp" and g < 2:
            fail(f"advantage {self.advantage!r} compares responses within a group: sampling.num_samples "
                 f"(G) must be >= 2, got {g}")
        if self.dynamic_sampling and g < 2:
            fail(f"dynamic_sampling needs groups: sampling.num_samples must be >= 2, got {g}")
        if self.sampling.temperature <= 0:
            fail(f"sampling.temperature must be > 0 for policy-gradient training, got {self.sampling.temperature}")
        if self.adv_eps < 0:
            fail(f"adv_eps must be >= 0, got {self.adv_eps}")
        if self.beta < 0:
            fail(f"beta must be >= 0, got {self.beta}")
        if self.kl_target is not None and not self.beta > 0:
            fail(f"kl_target={self.kl_target} adapts β from its start: beta must be > 0, got {self.beta}")
        try:
            self.kl_config
        except ValueError as e:
            fail(str(e))
        if self.clip_low <= 0 or (self.clip_high is not None and self.clip_high <= 0):
            fail(f"clip_low and clip_high must be > 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            fail(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.norm_len is not None and self.norm_len <= 0:
            fail(f"norm_len must be > 0, got {self.norm_len}")
        for name in ("num_iterations", "num_minibatches", "num_microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                fail(f"{name} must be an int >= 1, got {v!r}")
        if self.prompts_per_step is not None:
            if not self.dynamic_sampling:
                fail("prompts_per_step selects groups from an oversampled pool: it needs dynamic_sampling=True")
            if self.prompts_per_step < 1:
                fail(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if not self.guide_coef >= 0:
            fail(f"guide_coef must be >= 0 (0 = off), got {self.guide_coef}")
        if self.overlong_max_len is not None:
            if not 0 <= self.overlong_cache < self.overlong_max_len:
                fail(f"overlong_cache must be in [0, overlong_max_len={self.overlong_max_len}), "
                     f"got {self.overlong_cache}")

    @property
    def uses_reference(self) -> bool:
        """The reference model's log-probs are computed: β > 0 (the KL term) or `track_kl`."""
        return self.beta > 0 or self.track_kl

    @property
    def kl_config(self) -> kl_controller.KLControllerConfig:
        """β's controller: fixed at `beta`, or adaptive toward `kl_target`."""
        return kl_controller.KLControllerConfig(init_beta=self.beta, target=self.kl_target, horizon=self.kl_horizon)

    @property
    def group_size(self) -> int:
        return self.sampling.num_samples

    @property
    def loss_norm_len(self) -> int:
        return self.sampling.max_new_tokens if self.norm_len is None else self.norm_len

    def prompt_group(self, rows: int, *, shuffled: bool = False) -> int:
        """The `group_size` for a forward pass over `rows` rows (1: no prompt sharing)."""
        g = self.group_size
        share = self.share_prompt and g > 1 and not shuffled and rows % g == 0
        return g if share else 1

    @property
    def updates_per_iteration(self) -> int:
        """Optimizer steps one iteration makes (μ passes × minibatches): what a learning-rate
        schedule over a run of iterations counts."""
        return self.num_iterations * self.num_minibatches

    @property
    def reuses_rollout_logp(self) -> bool:
        """μ = 1 with one minibatch: the policy being updated *is* the rollout policy, so the
        old log-probs are the training forward's own (stop-gradient), ratio exactly 1, and
        no separate scoring pass is needed."""
        return self.num_iterations == 1 and self.num_minibatches == 1


_PRESETS = {
    # Original GRPO (DeepSeekMath): per-sequence token means, k3 KL in the loss.
    "grpo": dict(advantage="grpo", agg="seq-mean-token-mean", beta=0.04),
    # Dr. GRPO: no std division, a constant length normaliser, no KL.
    "dr_grpo": dict(advantage="dr_grpo", agg="seq-mean-token-sum-norm", beta=0.0),
    # DAPO: clip-higher, token-level loss, dynamic sampling, soft overlong penalty, no KL.
    "dapo": dict(advantage="grpo", agg="token-mean", clip_low=0.2, clip_high=0.28, beta=0.0,
                 dynamic_sampling=True),
    # GSPO: sequence-level ratio with a tight clip range, sequence-mean loss.
    "gspo": dict(advantage="grpo", ratio_level="sequence", agg="seq-mean-token-mean", clip_low=3e-4,
                 clip_high=4e-4, beta=0.0),
    # RLOO: leave-one-out baseline, one on-policy pass (the clip is then inactive).
    "rloo": dict(advantage="rloo", agg="seq-mean-token-mean", beta=0.0, num_iterations=1),
    # REINFORCE++: global whitening of the sequence scores, token-level loss.
    "reinforce_pp": dict(advantage="reinforce_pp", agg="token-mean", beta=0.0),
}


def preset(name: str, sampling: SamplingConfig, **overrides) -> GRPOConfig:
    """A `GRPOConfig` for a named variant ("grpo", "dr_grpo", "dapo", "gspo", "rloo",
    "reinforce_pp"); `overrides` change any field. "dapo" also turns on the overlong
    penalty with `overlong_max_len = max_new_tokens`, `overlong_cache = max_new_tokens // 5`.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {tuple(_PRESETS)}")
    fields = dict(_PRESETS[name])
    if name == "dapo":
        fields.update(overlong_max_len=sampling.max_new_tokens,
                      overlong_cache=max(sampling.max_new_tokens // 5, 0))
    fields.update(overrides)
    return GRPOConfig(sampling=sampling, **fields)


__all__ = ["ADVANTAGES", "RATIO_LEVELS", "GRPOConfig", "preset"]
