"""The GRPO family as pure functions: GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++.

All of them sample `G` responses per prompt, score them, turn the scores into critic-free
advantages and take clipped policy-gradient steps (SPEC §4–§6). They differ only in
options of one `GRPOConfig` (see `preset`):

- advantage: group-normalised "grpo" (Shao et al. 2024, arXiv:2402.03300), "dr_grpo"
  (no std, Liu et al. 2025, arXiv:2503.20783), leave-one-out "rloo" (Ahmadian et al.
  2024, arXiv:2402.14740), or "reinforce_pp": sequence scores broadcast to their tokens
  and whitened over the whole batch, no group baseline (REINFORCE++, Hu 2025,
  arXiv:2501.03262; here the KL stays in the loss, as in GRPO).
- loss: `ops.policy_loss` with clip-higher and dual clip, any `ops.aggregate` mode, plus
  `β·agg(k3)` to a frozen reference (β = 0: no reference model at all) and an entropy bonus.
- ratio: per token, or per sequence (GSPO, Zheng et al. 2025, arXiv:2507.18071):
  `s_i = exp(mean_t(logp − old_logp))`, broadcast to the tokens of response i and clipped.
- DAPO (Yu et al. 2025, arXiv:2503.14476): dynamic sampling (groups whose scores are all
  equal carry no signal; an oversampled prompt pool is filtered inside the step so that the
  update batch keeps a fixed size) and the soft overlong penalty.

    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=64, num_samples=8))
    state = grpo.init_state(params, tx)
    iteration = grpo.make_iteration(model, tx, cfg, reward)
    state, metrics = iteration(state, prompt_ids, prompt_mask, extras, rng)

An iteration is `rollout` (sampling) → `score` (reward, advantages, old/ref log-probs) →
`train` (μ × minibatch updates). `make_iteration` runs them as three timed programs
(`timing.run_split`: `time/rollout_s`, `time/scoring_s`, `time/update_s`, tokens/s), a host
(Python) reward scored between the first two; with `time_split=False` and a pure-JAX reward
the whole iteration is one XLA program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import flax
import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops
from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import common, scoring, timing
from jaxrlhf.algorithms.experience import SamplingConfig, sample_responses, score_responses
from jaxrlhf.algorithms.scoring import GroupSelection, overlong_penalty, select_groups
from jaxrlhf.models import lora
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout import buckets
from jaxrlhf.rollout.sampler import SampleOutput

PyTree = Any

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
      kl_estimator: "k3" (SPEC §3, the GRPO choice), or "k1" / "k2".
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
    """

    sampling: SamplingConfig
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    beta: float = 0.0
    track_kl: bool = False
    kl_estimator: str = "k3"
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

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"GRPOConfig: {msg}")

        if not isinstance(self.sampling, SamplingConfig):
            fail(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        for name, allowed in (("advantage", ADVANTAGES), ("ratio_level", RATIO_LEVELS),
                              ("kl_estimator", ops.KL_ESTIMATORS), ("agg", ops.AGGREGATE_MODES)):
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
        if self.overlong_max_len is not None:
            if not 0 <= self.overlong_cache < self.overlong_max_len:
                fail(f"overlong_cache must be in [0, overlong_max_len={self.overlong_max_len}), "
                     f"got {self.overlong_cache}")

    @property
    def uses_reference(self) -> bool:
        """The reference model's log-probs are computed: β > 0 (the KL term) or `track_kl`."""
        return self.beta > 0 or self.track_kl

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


@flax.struct.dataclass
class GRPOState:
    """The policy's `TrainState`, the frozen reference parameters (or None), iterations done."""

    policy: common.TrainState
    ref_params: PyTree
    step: jax.Array


def reference_params(state: GRPOState) -> PyTree:
    """The reference policy's params: `state.ref_params`, or when there are none and the
    policy has LoRA adapters, the policy's base params without them (`lora.without_adapters`:
    the same arrays, no copy). None when there is no reference."""
    if state.ref_params is None and lora.has_adapters(state.policy.params):
        return lora.without_adapters(state.policy.params)
    return state.ref_params


def init_state(params, tx: optax.GradientTransformation, ref_params=None) -> GRPOState:
    """The state of a run; pass `ref_params` (usually the starting params) when β > 0, or
    none when `params` hold LoRA adapters: the reference is then the base without them
    (`reference_params`).

    The policy holds `params` themselves; the reference gets buffers of its own: each leaf
    of `ref_params` that is also a leaf of `params` (`ref_params=params`, or a tree that
    shares some arrays with it) is copied, because an iteration with `donate=True` donates
    the whole state and XLA refuses to donate one buffer twice. Leaves that are already
    distinct arrays are kept as they are (no copy).
    """
    if ref_params is not None:
        policy_leaves = {id(x) for x in jax.tree.leaves(params)}
        ref_params = jax.tree.map(lambda x: jnp.copy(x) if id(x) in policy_leaves else x, ref_params)
    return GRPOState(policy=common.TrainState.create(params, tx), ref_params=ref_params,
                     step=jnp.zeros((), jnp.int32))


class Batch(NamedTuple):
    """One update batch of `N` responses (prompt length P, response length T).

    sequences, attention_mask: `[N, P + T]` prompt ⧺ response.
    response_mask: `[N, T]`, 1 on valid response tokens.
    advantages: `[N, T]` float32 per-token advantages.
    old_logp: `[N, T]` rollout-policy log-probs, or None: the current policy is the rollout
      policy (μ = 1, one minibatch) and the loss uses its own log-probs, stop-gradient.
    ref_logp: `[N, T]` reference log-probs, or None when β = 0.
    sampler_logp: `[N, T]` the sampler's log-probs (diagnostic `logp_mismatch`), or None.
    """

    sequences: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    sampler_logp: jax.Array | None = None


# --------------------------------------------------------------------------- advantages
# (score shaping — DAPO's overlong_penalty, dynamic sampling's select_groups — is in scoring)


def compute_advantages(scores: jax.Array, cfg: GRPOConfig, response_mask: jax.Array) -> jax.Array:
    """Per-token advantages `[N, T]` from sequence scores `[N]` (groups contiguous).

    Group methods: `ops.group_advantages(scores, G, method, eps=cfg.adv_eps)` broadcast to
    the valid tokens; "reinforce_pp": `ops.whiten` of the broadcast scores over the batch.
    """
    scores = jnp.asarray(scores, jnp.float32)
    if scores.ndim != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"compute_advantages: scores must be [N] with N = response_mask.shape[0] = "
                         f"{response_mask.shape[0]}, got {scores.shape}")
    g = cfg.group_size
    if cfg.advantage == "reinforce_pp":
        return ops.whiten(ops.broadcast_sequence(scores, response_mask), response_mask)
    if scores.shape[0] % g:
        raise ValueError(f"compute_advantages: {scores.shape[0]} responses do not split into groups of "
                         f"G = sampling.num_samples = {g}; the batch must hold whole groups")
    adv = ops.group_advantages(scores, g, method=cfg.advantage, eps=cfg.adv_eps)
    return ops.broadcast_sequence(adv, response_mask)


# --------------------------------------------------------------------------- loss


def importance_logp(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, *, level: str = "token") -> jax.Array:
    """The log-probs whose ratio to `old_logp` is the importance weight of the loss.

    "token": `logp` itself. "sequence" (GSPO): `old_logp_t + mean_t(logp − old_logp)` on the
    valid tokens of each response, so that `exp(· − old_logp) = s_i`, the length-normalised
    sequence ratio, for every token of response i; its gradient is `s_i·mean_t ∇logp_t`.
    """
    if level == "token":
        return logp
    if level != "sequence":
        raise ValueError(f"importance_logp: level must be 'token' or 'sequence', got {level!r}")
    mask = mask.astype(bool)
    diff = jnp.where(mask, logp - old_logp, 0.0)
    mean_diff = ops.masked_mean(diff, mask, axis=1)
    return jnp.where(mask, old_logp + mean_diff[:, None], logp)


def loss_fn(
    params,
    batch: Batch,
    cfg: GRPOConfig,
    *,
    model: Transformer,
    total_tokens: jax.Array | None = None,
    total_seqs: int | None = None,
    group_size: int = 1,
    dropout_rng: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The GRPO-family loss of one (micro)batch:

        L = agg(l_clip(ρ, A)) + β·agg(kl(logp, ref_logp)) − c_ent·agg(entropy)

    with `ρ` per token or per sequence (`cfg.ratio_level`). Given `total_tokens` (valid
    tokens of the whole minibatch) and `total_seqs`, the loss is scaled to this chunk's
    share of the minibatch loss (`common.accumulation_scale`), for accumulation.
    `dropout_rng`: LoRA adapter dropout on (`common.dropout_key`; None: off).

    Returns: `(loss, metrics)`; metrics are unscaled: `loss`, `pg_loss`, `clipfrac`,
    `approx_kl`, `ratio_mean/min/max`, `entropy`, and `kl` when the batch has reference
    log-probs (β > 0 or `track_kl`), `logp_mismatch`
    (max |logp − sampler_logp|) when the batch has sampler log-probs.
    """
    p = batch.sequences.shape[1] - batch.response_mask.shape[1]
    mask = batch.response_mask.astype(bool)
    logp, ent, _ = common.response_logprobs(model, params, batch.sequences, batch.attention_mask, p,
                                            temperature=cfg.sampling.temperature, with_entropy=True,
                                            group_size=group_size, dropout_rng=dropout_rng)
    old_logp = jax.lax.stop_gradient(logp) if batch.old_logp is None else batch.old_logp
    ratio_logp = importance_logp(logp, old_logp, mask, level=cfg.ratio_level)
    agg = dict(agg=cfg.agg, norm_len=cfg.loss_norm_len)
    pg_loss, pg = ops.policy_loss(ratio_logp, old_logp, batch.advantages, mask, clip_low=cfg.clip_low,
                                  clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, **agg)
    loss = pg_loss
    metrics = dict(pg, pg_loss=pg_loss, entropy=ops.masked_mean(jax.lax.stop_gradient(ent), mask))
    if cfg.beta > 0 and batch.ref_logp is None:
        raise ValueError("GRPO loss: beta > 0 needs ref_logp (a reference model)")
    if batch.ref_logp is not None:
        kl_BxT = ops.kl(logp, batch.ref_logp, estimator=cfg.kl_estimator)
        if cfg.beta > 0:
            loss = loss + cfg.beta * ops.aggregate(kl_BxT, mask, mode=cfg.agg, norm_len=cfg.loss_norm_len)
        metrics["kl"] = ops.masked_mean(jax.lax.stop_gradient(kl_BxT), mask)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * ops.aggregate(ent, mask, mode=cfg.agg, norm_len=cfg.loss_norm_len)
    if batch.sampler_logp is not None:
        gap = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp) - batch.sampler_logp), 0.0)
        metrics["logp_mismatch"] = jnp.max(gap)
    metrics["loss"] = jax.lax.stop_gradient(loss)
    if total_tokens is not None:
        seqs = batch.response_mask.shape[0] if total_seqs is None else total_seqs
        loss = loss * common.accumulation_scale(mask, mode=cfg.agg, total_tokens=total_tokens, total_seqs=seqs)
    return loss, metrics


# --------------------------------------------------------------------------- update

def update(state: GRPOState, batch: Batch, rng: jax.Array, *, model: Transformer,
           tx: optax.GradientTransformation, cfg: GRPOConfig) -> tuple[GRPOState, dict]:
    """μ passes × `num_minibatches` optimizer steps on one rollout batch, in one `lax.scan`.

    Each pass shuffles the rows (with `rng`, which also draws the LoRA adapter-dropout masks
    of each step and micro-batch: `common.dropout_key`) into minibatches; each minibatch's gradient is
    accumulated over `num_microbatches` chunks. A step whose gradient is not finite is
    skipped (parameters and optimizer state kept); `finite` is False if any was.

    Returns: `(state, metrics)`: loss metrics averaged over the steps (`ratio_max` and
    `logp_mismatch` maxed, `ratio_min` minimised; `first/ratio_max`, `first/ratio_min` and
    `first/approx_kl` from the first minibatch), `grad_norm` (mean global norm before
    clipping), `finite`, `skipped_steps`.
    """
    n = batch.response_mask.shape[0]
    mu, m, k = cfg.num_iterations, cfg.num_minibatches, cfg.num_microbatches
    if n % (m * k):
        raise ValueError(f"GRPO update: a batch of {n} responses does not split into num_minibatches={m} × "
                         f"num_microbatches={k} equal parts")
    if cfg.beta > 0 and batch.ref_logp is None:
        raise ValueError("GRPO update: beta > 0 needs ref_logp in the batch (init_state(..., ref_params=...))")
    mb_size = n // m

    def step(policy, mb):
        total_tokens = jnp.sum(mb.response_mask, dtype=jnp.float32)
        chunk_loss = functools.partial(_chunk_loss, cfg=cfg, model=model, total_tokens=total_tokens,
                                       total_seqs=mb_size, group_size=cfg.prompt_group(mb_size // k, shuffled=m > 1),
                                       dropout=functools.partial(common.dropout_key, model.config, rng, policy.step))
        loss, metrics, grads = common.accumulate_gradients(chunk_loss, policy.params, mb, num_microbatches=k)
        policy, finite = common.apply_if_finite(policy, grads, tx, loss)
        return policy, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), finite=finite)

    # One minibatch: the whole batch each pass, unshuffled.
    policy, stacked = common.minibatch_scan(step, state.policy, batch, rng, passes=mu, minibatches=m, shuffle=m > 1)
    metrics = common.summarize_steps(stacked, skipped="skipped_steps",
                                     first={f"first/{name}": name for name in ("ratio_max", "ratio_min", "approx_kl")})
    return state.replace(policy=policy), metrics


def _chunk_loss(params, chunk, index, *, cfg, model, total_tokens, total_seqs, group_size, dropout):
    return loss_fn(params, chunk, cfg, model=model, total_tokens=total_tokens, total_seqs=total_seqs,
                   group_size=group_size, dropout_rng=dropout(index))


# --------------------------------------------------------------------------- iteration


def rollout(state: GRPOState, prompt_ids, prompt_mask, rng, *, model: Transformer, cfg: GRPOConfig) -> SampleOutput:
    """Samples G responses per prompt: a `SampleOutput` of `N = B·G` rows, a prompt's
    samples contiguous."""
    key = jax.random.fold_in(jax.random.fold_in(rng, state.step), 0)
    return sample_responses(model, state.policy.params, prompt_ids, prompt_mask, key, cfg.sampling)


def score(state: GRPOState, out: SampleOutput, extras, host_scores: dict, rng, *, model: Transformer,
          cfg: GRPOConfig, reward: rewards_lib.Reward) -> tuple[Batch, dict]:
    """The reward's JAX components on `out` (given the prompts' `extras`, `[B, ...]`
    arrays, repeated per sample) beside its host ones' `host_scores` (`{name: [N]}`), then
    (overlong penalty) → (dynamic selection) → advantages → old/ref log-probs: the update's
    `Batch` and the rollout's metrics."""
    del rng
    g = cfg.group_size
    n_pool = out.response_ids.shape[0]
    if cfg.uses_reference and reference_params(state) is None:
        raise ValueError(f"GRPO with beta={cfg.beta}, track_kl={cfg.track_kl} needs a reference model: "
                         "init_state(params, tx, ref_params=...), or LoRA adapters on the policy")
    extras_N = scoring.repeat_extras(extras, g, n_pool // g)
    scores = {**reward.device_scores(rewards_lib.RewardInput.from_sample(out), extras_N), **host_scores}
    total = reward.total(scores)
    lengths = out.response_mask.sum(axis=1)
    metrics = dict(reward.metrics(scores))
    metrics.update({"reward/mean": jnp.mean(total), "reward/std": jnp.std(total),
                    "response_length/mean": jnp.mean(lengths.astype(jnp.float32)),
                    "response_length/max": jnp.max(lengths), "response_tokens": jnp.sum(lengths)})
    shaped = total
    if cfg.overlong_max_len is not None:
        penalty = overlong_penalty(lengths, max_len=cfg.overlong_max_len, cache_len=cfg.overlong_cache)
        shaped = total + cfg.overlong_coef * penalty
        metrics["overlong/penalty_mean"] = jnp.mean(penalty)
        metrics["overlong/clipped_fraction"] = jnp.mean(lengths > cfg.overlong_max_len - cfg.overlong_cache)
    if cfg.dynamic_sampling:
        k = n_pool // g if cfg.prompts_per_step is None else cfg.prompts_per_step
        sel = select_groups(shaped, g, k)
        out = jax.tree.map(lambda x: x[sel.indices], out)
        shaped = shaped[sel.indices]
        metrics.update({"dynamic/kept_fraction": sel.kept_fraction, "dynamic/signal_fraction": sel.signal_fraction})
    mask = out.response_mask
    adv = compute_advantages(shaped, cfg, mask)
    if cfg.dynamic_sampling:
        adv = jnp.where(jnp.repeat(sel.has_signal, g)[:, None], adv, 0.0)
    n = mask.shape[0]
    zero_group = jnp.all((adv == 0).reshape(n // g, -1), axis=1)  # n = K·G always
    var = ops.masked_var(adv, mask)
    metrics.update({"advantage/mean": ops.masked_mean(adv, mask), "advantage/std": jnp.sqrt(var),
                    "zero_adv_group_fraction": jnp.mean(zero_group.astype(jnp.float32))})

    p = out.sequences.shape[1] - mask.shape[1]
    temp = cfg.sampling.temperature
    forward = functools.partial(score_responses, model, sequences=out.sequences, attention_mask=out.attention_mask,
                                prompt_len=p, temperature=temp, group_size=cfg.prompt_group(n))
    old_logp = None if cfg.reuses_rollout_logp else forward(state.policy.params)
    ref_logp = forward(reference_params(state)) if cfg.uses_reference else None
    return Batch(out.sequences, out.attention_mask, mask, adv, old_logp, ref_logp, out.logprobs), metrics


def train(state: GRPOState, batch: Batch, rng, *, model: Transformer, tx: optax.GradientTransformation,
          cfg: GRPOConfig, schedule: Callable | None = None) -> tuple[GRPOState, dict]:
    """`update` on the scored batch with the iteration's update key, then the step count;
    `lr` in the metrics when given the `schedule`."""
    metrics = {} if schedule is None else {"lr": jnp.asarray(schedule(state.policy.step), jnp.float32)}
    key = jax.random.fold_in(jax.random.fold_in(rng, state.step), 1)
    state, upd = update(state, batch, key, model=model, tx=tx, cfg=cfg)
    return state.replace(step=state.step + 1), {**metrics, **upd}


def split(model: Transformer, tx: optax.GradientTransformation, cfg: GRPOConfig, reward, *,
          schedule: Callable | None = None) -> timing.Split:
    """The iteration as `timing.Split(rollout, score, train)` (pure functions, not jitted):
    `make_iteration` and the command line's sharded step (`runs.phases`) jit them."""
    reward = rewards_lib.as_reward(reward)
    return timing.Split(timing.count_tokens(functools.partial(rollout, model=model, cfg=cfg)),
                        functools.partial(score, model=model, cfg=cfg, reward=reward),
                        functools.partial(train, model=model, tx=tx, cfg=cfg, schedule=schedule))


def make_iteration(model: Transformer, tx: optax.GradientTransformation, cfg: GRPOConfig, reward, *,
                   schedule: Callable | None = None, donate: bool = False, time_split: bool = True,
                   prompt_buckets: Sequence[int] | None = buckets.DEFAULT_BUCKETS):
    """`iteration(state, prompt_ids, prompt_mask, extras, rng) -> (state, metrics)`.

    Args:
      model: the policy (LM head); the reference, if β > 0, has the same architecture.
      tx: the optimizer (e.g. `common.make_optimizer(...)[0]`).
      cfg: a `GRPOConfig`.
      reward: a `rewards.Reward` (or a bare JAX reward callable).
      schedule: the learning-rate schedule, only to report `lr`.
      donate: donate the state's buffers to the compiled program(s).
      time_split: run the iteration as three jitted programs (rollout, scoring, update;
        `timing.run_split`), each waited for, and report their times (`timing.RL_STEP`:
        `time/rollout_s`, `time/scoring_s`, `time/update_s`, `time/tokens_per_s`,
        `time/step_tokens_per_s`). False: a pure-JAX reward's iteration is one program and
        reports no times. The results are the same either way (float rounding aside).
      prompt_buckets: prompts are left-padded to the smallest of these lengths that holds
        them (`rollout.buckets`; powers of two from 16 by default; None: never), so that
        prompts of many lengths compile a handful of programs; `time/compiles` in the metrics
        counts the XLA compilations of each call.

    The iteration takes `prompt_ids`, `prompt_mask` `[B, P]` (left-padded; with dynamic
    sampling and `prompts_per_step` a pool of B ≥ prompts_per_step prompts), `extras` (a
    dict of `[B, ...]` arrays, repeated per sample for the rewards; host rewards may also
    get non-array values such as lists of B strings) and a PRNG key (folded with the
    step, so a constant key is fine).

    Called inside the caller's own jit (traced arguments) the iteration is the fused one
    program, with no times and no `time/compiles` (nothing can be timed there). A host
    (Python) reward always runs the three programs, scored between the rollout and the
    scoring program, with `time/host_reward_s`: the host reward alone (inside
    `time/scoring_s`). `iteration.compiled` is the tuple of the jitted programs in the order
    they run — `(fused,)` or `(rollout, score, train)` — e.g. for
    `iteration.compiled[0].lower(...)`; `iteration.is_single_program` says which.
    """
    reward = rewards_lib.as_reward(reward)
    parts = split(model, tx, cfg, reward, schedule=schedule)
    donate_args = (0,) if donate else ()
    pad = functools.partial(buckets.pad_to_bucket, buckets=prompt_buckets, pad_id=cfg.sampling.pad_id,
                            limit=model.config.max_position_embeddings - cfg.sampling.max_new_tokens)
    fused = jax.jit(parts.fused, donate_argnums=donate_args)
    programs = (jax.jit(parts.rollout), jax.jit(parts.score), jax.jit(parts.train, donate_argnums=donate_args))
    single = reward.is_jax and not time_split
    g = cfg.group_size

    def host(extras):
        if reward.is_jax:
            return None
        return lambda out: scoring.host_scores(reward, jax.device_get(out), extras, g, eos_id=cfg.sampling.eos_id)

    def iteration(state, prompt_ids, prompt_mask, extras=None, rng=None):
        arrays, _ = scoring.split_extras(extras)
        rng = _key(rng)
        if isinstance(prompt_ids, jax.core.Tracer):  # inside the caller's jit: nothing to time or count
            if not reward.is_jax:
                raise ValueError("a GRPO iteration with a host reward cannot run inside jit: call it eagerly")
            return parts.fused(state, *pad(prompt_ids, prompt_mask), arrays, rng)
        with buckets.CompileCounter() as compiles:
            if single:
                state, metrics = fused(state, *pad(prompt_ids, prompt_mask), arrays, rng)
            else:
                state, metrics = timing.run_split(*programs, state, *pad(prompt_ids, prompt_mask), arrays, rng,
                                                  host=host(extras))
        return state, {**metrics, timing.COMPILES: compiles.count}

    iteration.is_single_program = single
    iteration.compiled = (fused,) if single else programs
    return iteration


def _key(rng):
    if rng is None:
        raise ValueError("iteration needs a PRNG key (rng)")
    return rng


__all__ = ["ADVANTAGES", "Batch", "GRPOConfig", "GRPOState", "GroupSelection", "compute_advantages",
           "importance_logp", "init_state", "loss_fn", "make_iteration", "overlong_penalty", "preset", "rollout",
           "score", "select_groups", "split", "train", "update"]
