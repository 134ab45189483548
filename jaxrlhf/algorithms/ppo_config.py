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
from jaxrlhf.algorithms.offpolicy import CorrectionConfig
from jaxrlhf.algorithms.common import TrainState
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.algorithms.scoring import RunningMoments
from jaxrlhf.options import check, option

PyTree = Any

REWARD_WHITENING = (None, "batch", "running")
MISSING_EOS_MODES = ("subtract", "replace")
CRITIC_MODES = ("separate", "shared")


# --------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Every option of RLHF-PPO, each field's doc and bounds on the field
    (`jaxrlhf.options`; validated on construction). Defaults follow TRL's PPO where one
    exists (k1 KL, β 0.05, γ 1, λ 0.95, 4 epochs, clip 0.2, vf_coef 0.1). Scores pass
    missing-EOS penalty → whitening → clipping in that order (`process_scores`); the
    formulas: docs/concepts.md#kl-to-the-reference-in-the-reward-or-in-the-loss,
    #advantages-token-level-or-sequence-level and #the-clipped-losses."""

    sampling: SamplingConfig = option(doc="how responses are drawn (temperature τ also divides the logits of every "
                                      "log-prob)", factory=lambda: SamplingConfig(num_samples=1))
    kl_estimator: str = option("k1", "the per-token KL that enters the reward or the loss",
                               choices=ops.KL_ESTIMATORS)
    kl_in: str = option("reward", "'reward' (−β·kl on every token's reward before GAE) or 'loss' (β·agg(kl) in the "
                        "actor loss; the rewards are then the score alone)", choices=kl_terms.KL_PLACEMENTS)
    beta: float = option(0.05, "β, the weight of the KL to the reference (the starting β when adaptive)", min=0)
    kl_target: float | None = option(None, "None: a fixed β; else the target KL (nats per response, summed over its "
                                     "tokens) of the adaptive controller (Ziegler et al. 2019)", above=0)
    kl_horizon: int = option(10_000, "the adaptive controller's horizon in samples", min=1)
    missing_eos_penalty: float | None = option(None, "p for responses that reach max_new_tokens without EOS: the "
                                               "score becomes score − p ('subtract', TRL's) or −p ('replace'); "
                                               "None: off", min=0)
    missing_eos_mode: str = option("subtract", "how missing_eos_penalty applies", choices=MISSING_EOS_MODES)
    reward_whitening: str | None = option(None, "None, 'batch' ((s − mean)/std over the batch) or 'running' (with "
                                          "running moments over all batches so far) of the scores (OpenRLHF's "
                                          "normalize_reward; TRL's whiten_rewards is another thing)",
                                          choices=REWARD_WHITENING)
    reward_clip: float | None = option(None, "c clips the scores to [−c, c] after whitening; None: off", above=0)
    gamma: float = option(1.0, "γ of GAE", min=0, max=1)
    lam: float = option(0.95, "λ of GAE", min=0, max=1)
    whiten_advantages: bool = option(True, "whiten the advantages over the batch (`ops.whiten`, with mean)")
    clip_low: float = option(0.2, "ε_low of the clipped ratio", above=0)
    clip_high: float | None = option(None, "ε_high of the clipped ratio; None: clip_low", above=0)
    dual_clip: float | None = option(None, "c > 1 bounds the loss of negative-advantage tokens; None: off", above=1)
    correction: CorrectionConfig = option(doc="the off-policy correction for samples drawn by another policy than "
                                          "the proximal one (the rollout actor's recomputed old_logp; rollout "
                                          "ahead of learning, `runs.pipeline`): importance weights on the policy "
                                          "loss, or the sampler's log-probs as old_logp (`algorithms.offpolicy`)",
                                          factory=CorrectionConfig)
    vf_clip: float | None = option(0.2, "ε_v of the clipped value loss; None: no clipping", above=0)
    vf_coef: float = option(0.1, "c_v, the value loss's weight", min=0)
    entropy_coef: float = option(0.0, "c_ent of the entropy bonus − c_ent·agg(entropy)", min=0)
    agg: str = option("token-mean", "how every per-token loss becomes one number (`ops.aggregate`; "
                      "'seq-mean-token-sum-norm' with L = max_new_tokens)", choices=ops.AGGREGATE_MODES)
    num_ppo_epochs: int = option(4, "K passes over each rollout batch", min=1)
    num_minibatches: int = option(1, "M minibatches per pass (the batch must split into M)", min=1)
    num_microbatches: int = option(1, "gradient accumulation chunks per minibatch (the same gradients as one)",
                                   min=1)
    critic: str = option("separate", "'separate' (a score-head model with its own params and optimizer) or "
                         "'shared' (the actor's value head: one param tree, the value loss also trains the trunk)",
                         choices=CRITIC_MODES)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"PPOConfig: {msg}")

        if not isinstance(self.sampling, SamplingConfig):
            bad(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        check(self)
        # The controller config validates beta / kl_target / kl_horizon together.
        try:
            self.kl_config
        except ValueError as e:
            bad(str(e))
        if self.missing_eos_penalty is not None and self.sampling.eos_id is None:
            bad("missing_eos_penalty needs sampling.eos_id (without an EOS token every response would be penalised)")

    @property
    def kl_config(self) -> kl_controller.KLControllerConfig:
        return kl_controller.KLControllerConfig(init_beta=self.beta, target=self.kl_target,
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
