"""RLHF-PPO's options, `PPOConfig` (validated on construction), and the type of its state,
`PPOState`; the algorithm itself is `algorithms.ppo`, which re-exports both. Kept apart so
that `ppo_rollout` and `ppo_loss` need not import `ppo`, which imports them."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax

from jaxrlhf import ops
from jaxrlhf.algorithms import kl_controller, kl_terms
from jaxrlhf.algorithms.common import TrainState
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.algorithms.scoring import RunningMoments

PyTree = Any

REWARD_WHITENING = (None, "batch", "running")
MISSING_EOS_MODES = ("subtract", "replace")
CRITIC_MODES = ("separate", "shared")


# --------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Every knob of RLHF-PPO, validated at construction. Defaults follow TRL's PPO where
    one exists (k1 KL, β 0.05, γ 1, λ 0.95, 4 epochs, clip 0.2, vf_coef 0.1).

    Rollout:
      sampling: how responses are drawn (`max_new_tokens`, temperature τ — which also
        divides the logits of every log-prob —, top-k/p, `eos_id`, `num_samples`).

    KL to the reference (docs/concepts.md#kl-to-the-reference-in-the-reward-or-in-the-loss):
      kl_in: "reward" (−β·kl on every token's reward before GAE, `ops.shape_rewards`) or
        "loss" (β·agg(kl) added to the actor loss, `kl_terms.loss_term`; the rewards are
        then the score alone).
      kl_estimator: "k1" | "k2" | "k3", the per-token KL that enters the reward or loss.
      kl_coef: β (the starting β when adaptive).
      kl_target: None for a fixed β; else the target KL (nats per response, summed over
        its tokens with `kl_estimator`) of the adaptive controller (Ziegler et al. 2019).
      kl_horizon: the controller's horizon in samples.

    Scores (applied in this order, see `process_scores`):
      missing_eos_penalty: p ≥ 0, or None. For responses that reach `max_new_tokens`
        without emitting `sampling.eos_id`: with `missing_eos_mode="subtract"` the score
        becomes `score − p` (TRL's `missing_eos_penalty`); with "replace" it becomes `−p`,
        whatever the reward model said. Needs `sampling.eos_id`.
      reward_whitening: None, "batch" ((s − mean)/std over this batch) or "running"
        ((s − mean)/std with running moments over all batches so far, this one included).
        Note: TRL's `whiten_rewards` whitens the *shaped per-token* rewards without mean
        shift; this option normalises the *scores* (OpenRLHF's `normalize_reward`).
      reward_clip: c > 0 clips scores to [−c, c] (after whitening), or None.

    Advantages (docs/concepts.md#advantages-token-level-or-sequence-level):
      gamma, lam (GAE); whiten_advantages (`ops.whiten`, with mean).

    Loss (docs/concepts.md#the-clipped-losses):
      clip: ε (ε_low); clip_high: ε_high (None = ε); dual_clip: c > 1 or None.
      vf_clip: ε_v of the clipped value loss, None = no clipping. vf_coef: c_v.
      ent_coef: c_ent ≥ 0 of the entropy bonus.
      agg: aggregation of every per-token loss ("token-mean", "seq-mean-token-mean",
        "seq-mean-token-sum", "seq-mean-token-sum-norm" with L = max_new_tokens).

    Update: num_ppo_epochs K, num_minibatches M (N must split into M minibatches), and
      num_microbatches per minibatch (gradient accumulation; same gradients as 1).

    critic: "separate" (a "score"-head Transformer with its own params and optimizer; may
      differ in size) or "shared" (the actor has `head="lm_value"`: one param tree, one
      optimizer, the value loss also trains the trunk).
    """

    sampling: SamplingConfig
    kl_estimator: str = "k1"
    kl_in: str = "reward"
    kl_coef: float = 0.05
    kl_target: float | None = None
    kl_horizon: int = 10_000
    missing_eos_penalty: float | None = None
    missing_eos_mode: str = "subtract"
    reward_whitening: str | None = None
    reward_clip: float | None = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    clip: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    vf_clip: float | None = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    agg: str = "token-mean"
    num_ppo_epochs: int = 4
    num_minibatches: int = 1
    num_microbatches: int = 1
    critic: str = "separate"

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"PPOConfig: {msg}")

        if not isinstance(self.sampling, SamplingConfig):
            bad(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        if self.kl_estimator not in ops.KL_ESTIMATORS:
            bad(f"kl_estimator={self.kl_estimator!r}; expected one of {ops.KL_ESTIMATORS}")
        if self.kl_in not in kl_terms.KL_PLACEMENTS:
            bad(f"kl_in={self.kl_in!r}; expected one of {kl_terms.KL_PLACEMENTS}")
        # The controller config validates kl_coef / kl_target / kl_horizon.
        try:
            self.kl_config
        except ValueError as e:
            bad(str(e))
        if self.missing_eos_penalty is not None:
            if not self.missing_eos_penalty >= 0:
                bad(f"missing_eos_penalty must be >= 0 (it is subtracted), got {self.missing_eos_penalty}")
            if self.sampling.eos_id is None:
                bad("missing_eos_penalty needs sampling.eos_id (without an EOS token every response "
                    "would be penalised)")
        if self.missing_eos_mode not in MISSING_EOS_MODES:
            bad(f"missing_eos_mode={self.missing_eos_mode!r}; expected one of {MISSING_EOS_MODES}")
        if self.reward_whitening not in REWARD_WHITENING:
            bad(f"reward_whitening={self.reward_whitening!r}; expected one of {REWARD_WHITENING}")
        if self.reward_clip is not None and not self.reward_clip > 0:
            bad(f"reward_clip must be > 0 or None, got {self.reward_clip}")
        if not 0.0 <= self.gamma <= 1.0:
            bad(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            bad(f"lam must be in [0, 1], got {self.lam}")
        if not self.clip > 0:
            bad(f"clip must be > 0, got {self.clip}")
        if self.clip_high is not None and not self.clip_high > 0:
            bad(f"clip_high must be > 0 or None, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            bad(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.vf_clip is not None and not self.vf_clip > 0:
            bad(f"vf_clip must be > 0 or None, got {self.vf_clip}")
        if not self.vf_coef >= 0:
            bad(f"vf_coef must be >= 0, got {self.vf_coef}")
        if not self.ent_coef >= 0:
            bad(f"ent_coef must be >= 0, got {self.ent_coef}")
        if self.agg not in ops.AGGREGATE_MODES:
            bad(f"agg={self.agg!r}; expected one of {ops.AGGREGATE_MODES}")
        for name in ("num_ppo_epochs", "num_minibatches", "num_microbatches"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                bad(f"{name} must be an integer >= 1, got {v!r}")
        if self.critic not in CRITIC_MODES:
            bad(f"critic={self.critic!r}; expected one of {CRITIC_MODES}")

    @property
    def kl_config(self) -> kl_controller.KLControllerConfig:
        return kl_controller.KLControllerConfig(init_beta=self.kl_coef, target=self.kl_target,
                                                horizon=self.kl_horizon)

    @property
    def norm_len(self) -> int | None:
        return self.sampling.max_new_tokens if self.agg == "seq-mean-token-sum-norm" else None

    @property
    def updates_per_iteration(self) -> int:
        """Optimizer steps one iteration makes (epochs × minibatches): what a learning-rate
        schedule over a run of iterations counts."""
        return self.num_ppo_epochs * self.num_minibatches

    @property
    def shared(self) -> bool:
        return self.critic == "shared"


@flax.struct.dataclass
class PPOState:
    """actor: TrainState (params include the value head when the trunk is shared).
    critic: TrainState of the separate critic, or None when shared; its params may be a
      LoRA part on the actor's base (`on_actor`).
    ref_params: frozen reference (a copy of the starting actor), or None when the actor
      has LoRA adapters: the reference is then its base (`reference_params`).
    reward_params: frozen reward-model params (maybe a LoRA part on the actor's base), or
      None for a parameter-free reward.
    kl_ctl: the KL controller (β). reward_stats: running score moments.
    step: PPO iterations done (RNG is `fold_in(rng, step)`)."""

    actor: TrainState
    critic: TrainState | None
    ref_params: PyTree
    reward_params: PyTree
    kl_ctl: kl_controller.KLControllerState
    reward_stats: RunningMoments
    step: jax.Array
