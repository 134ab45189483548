"""The GRPO family's options: `GRPOConfig` (validated on construction) and the named
variants of `preset` (GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++ and its group-baseline
form, CISPO, GDPO); the algorithm itself
is `algorithms.grpo`, which re-exports both."""

from __future__ import annotations

import dataclasses
import warnings

from jaxrlhf import ops
from jaxrlhf.algorithms import advantages, kl_controller, kl_terms
from jaxrlhf.algorithms.offpolicy import CorrectionConfig
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.options import check, option

ADVANTAGES = advantages.names()  # the built-in six; `advantages.register_advantage` adds more
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("clip", "cispo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Every option of the GRPO family, each field's doc and bounds on the field
    (`jaxrlhf.options`; validated on construction). The formulas:
    docs/concepts.md#grpo-and-its-variants-dr-grpo-dapo."""

    sampling: SamplingConfig = option(doc="how responses are drawn; `sampling.num_samples` is the group size G",
                                      factory=lambda: SamplingConfig(num_samples=8))
    advantage: str = option("grpo", "the advantage estimator (`algorithms.advantages`): 'grpo' (group z-score "
                            "(s − mean_g)/(std_g + adv_eps)), 'dr_grpo' (no std division: s − mean_g), 'rloo' "
                            "(leave-one-out: s_i less the mean of the group's others), 'reinforce_pp' (`ops.whiten` "
                            "of the scores broadcast to tokens over the batch: no group baseline, G may be 1), "
                            "'reinforce_pp_baseline' (the group mean subtracted, then whitened over the batch), 'gdpo' "
                            "(each reward component z-scored in its group, the weighted sum whitened over the batch: "
                            "needs a reward of >= 2 weighted components), or one registered with register_advantage",
                            choices=advantages.names)
    adv_eps: float = option(1e-6, "ε of 'grpo' advantages (s − mean)/(std + ε) (TRL uses 1e-4)", min=0)
    beta: float = option(0.0, "β, the weight of the KL to the reference; 0 (and no track_kl) needs no reference "
                         "model: ref_logp is never computed", min=0)
    track_kl: bool = option(False, "with β = 0, still keep the reference model and report `kl/mean` without putting "
                            "it in the loss (one more forward pass per step): the health monitor's drift check then "
                            "works for unregularised runs too; on whenever train.monitor.kl_target is set")
    kl_estimator: str = option("k3", "the per-token KL estimator: 'k3' (the GRPO choice), 'k1' or 'k2'",
                               choices=ops.KL_ESTIMATORS)
    kl_in: str = option("loss", "'loss' (β·agg(kl) in the loss) or 'reward' (each score less β·Σ_t kl_t before "
                        "the advantages)", choices=kl_terms.KL_PLACEMENTS)
    kl_target: float | None = option(None, "None: a fixed β; else the target KL (nats per response) of the adaptive "
                                     "controller, which starts at beta (needs beta > 0)", above=0)
    kl_horizon: int = option(10_000, "the adaptive KL controller's horizon in samples", min=1)
    policy_loss: str = option("clip", "the policy-gradient term: 'clip' (PPO/GRPO's clipped surrogate, "
                              "`ops.policy_loss`: a clipped token gets no gradient) or 'cispo' (CISPO, `ops.cispo_loss`: "
                              "REINFORCE weighted by the stop-gradient ratio clipped to [1 − clip_low, 1 + clip_high], "
                              "every token keeps its gradient; the ratio moves off 1 only with num_iterations or "
                              "num_minibatches > 1, else it is plain REINFORCE)", choices=POLICY_LOSSES)
    clip_low: float = option(0.2, "ε_low of the clipped ratio ('cispo': 1 or more = no lower bound)", above=0)
    clip_high: float | None = option(None, "ε_high of the clipped ratio (DAPO's clip-higher: > clip_low); None: "
                                     "clip_low", above=0)
    dual_clip: float | None = option(None, "c > 1 bounds the loss of negative-advantage tokens by −c·A; None: off",
                                     above=1)
    agg: str = option("token-mean", "how per-token losses become one number (`ops.aggregate`)",
                      choices=ops.AGGREGATE_MODES)
    norm_len: int | None = option(None, "L of agg='seq-mean-token-sum-norm'; None: sampling.max_new_tokens",
                                  min=1)
    entropy_coef: float = option(0.0, "c_ent of the entropy bonus − c_ent·agg(entropy)", min=0)
    num_iterations: int = option(1, "μ, passes over each rollout batch (μ > 1 reuses the rollout's old "
                                 "log-probs, so the ratio moves away from 1 after the first minibatch)", min=1)
    num_minibatches: int = option(1, "optimizer steps per pass (rows shuffled each pass)", min=1)
    num_microbatches: int = option(1, "gradient-accumulation chunks per minibatch (the same result as one chunk for "
                                   "every agg, `common.accumulation_scale`)", min=1)
    ratio_level: str = option("token", "'token' (PPO/GRPO) or 'sequence' (GSPO: s_i = exp(mean_t(logp − "
                              "old_logp)) on every token of response i, clipped)", choices=RATIO_LEVELS)
    dynamic_sampling: bool = option(False, "zero the advantages of groups whose scores are all equal and keep "
                                    "`prompts_per_step` groups with signal from an oversampled pool "
                                    "(grpo.pool_size)")
    prompts_per_step: int | None = option(None, "groups in the update batch under dynamic sampling (the iteration "
                                          "is then given a pool of at least this many prompts); None keeps every "
                                          "prompt", min=1, cli=False)
    overlong_max_len: int | None = option(None, "DAPO's soft overlong penalty: the length L_max in tokens past "
                                          "which the penalty is whole, −1 (`overlong_penalty`); None: off", min=1)
    overlong_cache: int = option(0, "the penalty's ramp L_cache in tokens, below overlong_max_len: 0 up to "
                                 "L_max − L_cache, then ((L_max − L_cache) − len)/L_cache", min=0)
    overlong_coef: float = option(1.0, "the weight of that penalty, added to the score before advantages", min=0)
    share_prompt: bool = option(True, "run each group's prompt once in the scoring and training forward passes, its "
                                "G responses on the prompt's keys and values: the same numbers up to float "
                                "rounding, (P + T)·G → P + T·G tokens; used wherever rows stay in whole groups")
    correction: CorrectionConfig = option(doc="the off-policy correction for samples drawn by another policy than "
                                          "the proximal one (the sampler's numerics; rollout ahead of learning, "
                                          "`runs.pipeline`): importance weights, or the sampler's log-probs as "
                                          "old_logp (`algorithms.offpolicy`)", factory=CorrectionConfig)
    guide_coef: float = option(0.0, "c > 0 adds c· the token-mean NLL of the prompt's reference completion for "
                               "every prompt whose group's best score is below guide_below (`algorithms.guide`: "
                               "supervised guidance on the prompts RL gets no signal from, as in ReLIFT / SRFT); "
                               "the task must have reference completions. 0: off", min=0)
    guide_below: float = option(1.0, "the threshold on a group's best score (the reward's total, before any shaping) "
                                "under which its prompt counts as failed")

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"GRPOConfig: {msg}")

        if not isinstance(self.sampling, SamplingConfig):
            fail(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        check(self)
        g = self.sampling.num_samples
        if self.advantage in advantages.GROUPED and g < 2:
            fail(f"advantage {self.advantage!r} compares responses within a group: sampling.num_samples "
                 f"(G) must be >= 2, got {g}")
        if self.dynamic_sampling and g < 2:
            fail(f"dynamic_sampling needs groups: sampling.num_samples must be >= 2, got {g}")
        if self.kl_target is not None and not self.beta > 0:
            fail(f"kl_target={self.kl_target} adapts β from its start: beta must be > 0, got {self.beta}")
        try:
            self.kl_config
        except ValueError as e:
            fail(str(e))
        if self.prompts_per_step is not None and not self.dynamic_sampling:
            fail("prompts_per_step selects groups from an oversampled pool: it needs dynamic_sampling=True")
        if self.overlong_max_len is not None and not self.overlong_cache < self.overlong_max_len:
            fail(f"overlong_cache must be in [0, overlong_max_len={self.overlong_max_len}), got {self.overlong_cache}")
        if self.policy_loss == "cispo":
            if self.dual_clip is not None:
                fail(f"dual_clip={self.dual_clip} bounds the clipped surrogate's loss; policy_loss='cispo' has none "
                     "to bound: set dual_clip=None")
            if self.ratio_level != "token":
                fail("policy_loss='cispo' weights each token's log-prob by its own clipped ratio: ratio_level must "
                     f"be 'token', got {self.ratio_level!r}")
            if self.reuses_rollout_logp:
                warnings.warn("GRPOConfig: policy_loss='cispo' with num_iterations=1 and num_minibatches=1 updates "
                              "the rollout policy itself, so its ratio is always 1: it is plain REINFORCE with these "
                              "advantages. Use num_minibatches >= 2 (or num_iterations >= 2).", stacklevel=3)

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
    # REINFORCE++-baseline: the group mean out, then whitened over the batch.
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline", agg="token-mean", beta=0.0),
    # CISPO (MiniMax-M1): the clipped ratio as a stop-gradient weight, no lower bound
    # (ε_low = 1), a wide upper one; two minibatches so the ratio leaves 1.
    "cispo": dict(policy_loss="cispo", advantage="grpo", agg="token-mean", clip_low=1.0, clip_high=4.0, beta=0.0,
                  num_minibatches=2),
    # GDPO: each reward component normalised in its group, then the weighted sum over the batch.
    "gdpo": dict(advantage="gdpo", agg="token-mean", beta=0.0),
}


def preset(name: str, sampling: SamplingConfig, **overrides) -> GRPOConfig:
    """A `GRPOConfig` for a named variant ("grpo", "dr_grpo", "dapo", "gspo", "rloo",
    "reinforce_pp", "reinforce_pp_baseline", "cispo", "gdpo"); `overrides` change any
    field. "dapo" also turns on the overlong penalty with `overlong_max_len = max_new_tokens`, `overlong_cache = max_new_tokens // 5`.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {tuple(_PRESETS)}")
    fields = dict(_PRESETS[name])
    if name == "dapo":
        fields.update(overlong_max_len=sampling.max_new_tokens,
                      overlong_cache=max(sampling.max_new_tokens // 5, 0))
    fields.update(overrides)
    return GRPOConfig(sampling=sampling, **fields)


__all__ = ["ADVANTAGES", "POLICY_LOSSES", "RATIO_LEVELS", "GRPOConfig", "preset"]
