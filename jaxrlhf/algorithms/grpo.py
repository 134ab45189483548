"""The GRPO family as pure functions: GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++ (and
its group-baseline form), CISPO, GDPO.

All of them sample `G` responses per prompt, score them, turn the scores into critic-free
advantages and take clipped policy-gradient steps (docs/concepts.md#the-algorithms). They
differ only in options of one `GRPOConfig` (see `preset`):

- advantage: group-normalised "grpo" (Shao et al. 2024, arXiv:2402.03300), "dr_grpo"
  (no std, Liu et al. 2025, arXiv:2503.20783), leave-one-out "rloo" (Ahmadian et al.
  2024, arXiv:2402.14740), or "reinforce_pp": sequence scores broadcast to their tokens
  and whitened over the whole batch, no group baseline (REINFORCE++, Hu 2025,
  arXiv:2501.03262; here the KL stays in the loss, as in GRPO), "reinforce_pp_baseline"
  (the group mean out, then whitened over the batch), or "gdpo": each reward component
  z-scored in its group, then the weighted sum whitened over the batch (GDPO, Liu et al.
  2026, arXiv:2601.05242).
- loss: `ops.policy_loss` with clip-higher and dual clip, or `policy_loss="cispo"`:
  `ops.cispo_loss`, REINFORCE weighted by the clipped, stop-gradient ratio (CISPO,
  MiniMax-M1, arXiv:2506.13585), any `ops.aggregate` mode, plus
  `β·agg(k3)` to a frozen reference (β = 0: no reference model at all) and an entropy bonus.
  `kl_in="reward"` moves the KL into the score instead (`kl_terms.sequence_reward`), and a
  `kl_target` adapts β (`kl_controller`).
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

import functools
from typing import Any, Callable, NamedTuple, Sequence

import flax
import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops
from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import advantages, common, guide, kl_controller, kl_terms, offpolicy, scoring, timing
from jaxrlhf.algorithms.experience import sample_responses, score_responses
from jaxrlhf.algorithms.grpo_config import ADVANTAGES, RATIO_LEVELS, GRPOConfig, preset
from jaxrlhf.algorithms.scoring import GroupSelection, overlong_penalty, select_groups
from jaxrlhf.models import lora
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.rollout import buckets
from jaxrlhf.rollout.sampler import SampleOutput

PyTree = Any

@flax.struct.dataclass
class GRPOState:
    """The policy's `TrainState`, the frozen reference parameters (or None), iterations
    done, β's adaptive controller (None: β is the config's fixed `beta`), and the frozen
    parameters of the reward's model component that takes them at call time (None: none;
    `reward_model.as_reward`)."""

    policy: common.TrainState
    ref_params: PyTree
    step: jax.Array
    kl_ctl: kl_controller.KLControllerState | None = None
    reward_params: PyTree = None


def current_beta(state: GRPOState, cfg: GRPOConfig) -> float | jax.Array:
    """β of this iteration: the adaptive controller's, or the fixed `cfg.beta`."""
    if cfg.kl_config.adaptive:
        if state.kl_ctl is None:
            raise ValueError("GRPO with kl_target adapts β: init_state(params, tx, ..., cfg=cfg)")
        return state.kl_ctl.beta
    return cfg.beta


def reference_params(state: GRPOState) -> PyTree:
    """The reference policy's params: `state.ref_params`, or when there are none and the
    policy has LoRA adapters, the policy's base params without them (`lora.without_adapters`:
    the same arrays, no copy). None when there is no reference."""
    if state.ref_params is None and lora.has_adapters(state.policy.params):
        return lora.without_adapters(state.policy.params)
    return state.ref_params


def init_state(params, tx: optax.GradientTransformation, ref_params=None, *,
               cfg: GRPOConfig | None = None, reward_params=None) -> GRPOState:
    """The state of a run; pass `ref_params` (usually the starting params) when β > 0, or
    none when `params` hold LoRA adapters: the reference is then the base without them
    (`reference_params`). Pass `cfg` when it has a `kl_target`: the state then holds β's
    adaptive controller. `reward_params`: a frozen reward model's (`reward_model.as_reward`),
    given to the reward at every scoring, an argument of the compiled program.

    The policy holds `params` themselves; the reference gets buffers of its own: each leaf
    of `ref_params` that is also a leaf of `params` (`ref_params=params`, or a tree that
    shares some arrays with it) is copied, because an iteration with `donate=True` donates
    the whole state and XLA refuses to donate one buffer twice. Leaves that are already
    distinct arrays are kept as they are (no copy).
    """
    if ref_params is not None:
        policy_leaves = {id(x) for x in jax.tree.leaves(params)}
        ref_params = jax.tree.map(lambda x: jnp.copy(x) if id(x) in policy_leaves else x, ref_params)
    kl_ctl = kl_controller.init(cfg.kl_config) if cfg is not None and cfg.kl_config.adaptive else None
    return GRPOState(policy=common.TrainState.create(params, tx), ref_params=ref_params,
                     step=jnp.zeros((), jnp.int32), kl_ctl=kl_ctl, reward_params=reward_params)


class Batch(NamedTuple):
    """One update batch of `N` responses (prompt length P, response length T).

    sequences, attention_mask: `[N, P + T]` prompt ⧺ response.
    response_mask: `[N, T]`, 1 on valid response tokens.
    advantages: `[N, T]` float32 per-token advantages.
    old_logp: `[N, T]` rollout-policy log-probs, or None: the current policy is the rollout
      policy (μ = 1, one minibatch) and the loss uses its own log-probs, stop-gradient.
    ref_logp: `[N, T]` reference log-probs, or None when β = 0.
    sampler_logp: `[N, T]` the sampler's log-probs (diagnostic `logp_mismatch`), or None.
    kl_N: `[N]` the rollout policy's KL to the reference per response (`kl_terms.sequence_kl`),
      the adaptive β's measurement; None without a `kl_target`.
    guide_ids, guide_mask: `[N, R]` the reference completion of each row's prompt and its
      mask, on only the first row of each failed group (`guide.guide_rows`); None without
      `guide_coef`.
    behaviour_logp: `[N, T]` the log-probs of the distribution the sampler drew from, when
      that is not softmax(logits/τ) (top-k / top-p, `SampleOutput.behaviour_logprobs`);
      None: `sampler_logp` is the behaviour policy's.
    """

    sequences: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    sampler_logp: jax.Array | None = None
    kl_N: jax.Array | None = None
    guide_ids: jax.Array | None = None
    guide_mask: jax.Array | None = None
    behaviour_logp: jax.Array | None = None


# --------------------------------------------------------------------------- advantages
# (score shaping — DAPO's overlong_penalty, dynamic sampling's select_groups — is in scoring)


def compute_advantages(scores: jax.Array, cfg: GRPOConfig, response_mask: jax.Array, *,
                       scored: jax.Array | None = None,
                       components: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Per-token advantages `[N, T]` from sequence scores `[N]` (groups contiguous).

    `cfg.advantage` names the estimator (`algorithms.advantages`): the group methods
    `ops.group_advantages(scores, G, method, eps=cfg.adv_eps, mask=scored)` broadcast to the
    valid tokens; "reinforce_pp": `ops.whiten` of the broadcast scores over the batch; or a
    registered one. `scored` `[N]` bool (None: all): the rows that have a score; the others get 0
    and are left out of every baseline (`Reward.scored`). `components=(scores_NxK,
    weights_K)`: the reward's components and weights (`reward_components`), which "gdpo"
    (`ops.gdpo_advantages`) normalises apart; the other estimators ignore them.
    """
    scores = jnp.asarray(scores, jnp.float32)
    if scores.ndim != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"compute_advantages: scores must be [N] with N = response_mask.shape[0] = "
                         f"{response_mask.shape[0]}, got {scores.shape}")
    return advantages.estimate(cfg.advantage, scores, response_mask, cfg, scored, components=components)


def reward_components(reward: rewards_lib.Reward, scores: dict) -> tuple[jax.Array, jax.Array]:
    """`(scores_NxK, weights_K)`: each component's `[N]` scores, unweighted (a host
    component's missing score, its function's None, as 0: what `Reward.total` adds), and
    the components' weights, so that `scores_NxK @ weights_K` is `reward.total(scores)`."""
    columns = [jnp.asarray(scores[c.name], jnp.float32) for c in reward.components]
    scores_NxK = jnp.stack([jnp.where(jnp.isnan(x), 0.0, x) for x in columns], axis=1)
    return scores_NxK, jnp.asarray([c.weight for c in reward.components], jnp.float32)


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


def policy_term(logp: jax.Array, old_logp: jax.Array, advantages_NxT: jax.Array, mask: jax.Array,
                cfg: GRPOConfig, is_weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The policy-gradient term of the loss and its metrics (`clipfrac`, `approx_kl`,
    `ratio_mean/min/max`): `cfg.policy_loss` "clip", `ops.policy_loss` (clip-higher, dual
    clip), or "cispo", `ops.cispo_loss` with ε_low = `clip_low`, ε_high = `clip_high`
    (None: `clip_low`); aggregated by `cfg.agg`, each token's term times `is_weights`
    when given (`offpolicy.correction`)."""
    agg = dict(agg=cfg.agg, norm_len=cfg.loss_norm_len, is_weights=is_weights)
    if cfg.policy_loss == "cispo":
        high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
        return ops.cispo_loss(logp, old_logp, advantages_NxT, mask, clip_low=cfg.clip_low, clip_high=high, **agg)
    return ops.policy_loss(logp, old_logp, advantages_NxT, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                           dual_clip=cfg.dual_clip, **agg)


def loss_fn(
    params,
    batch: Batch,
    cfg: GRPOConfig,
    *,
    model: Transformer,
    total_tokens: jax.Array | None = None,
    total_seqs: int | None = None,
    group_size: int = 1,
    beta: float | jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    guide_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The GRPO-family loss of one (micro)batch:

        L = agg(l_pg(ρ, A)) + β·agg(kl(logp, ref_logp)) − c_ent·agg(entropy) + c_guide·NLL_guide

    with `l_pg` the clipped surrogate or CISPO's (`policy_term`), `ρ` per token or per
    sequence (`cfg.ratio_level`), the KL term only with
    `cfg.kl_in == "loss"` (`kl_terms.loss_term`; `beta`: this iteration's β, None =
    `cfg.beta`). Given `total_tokens` (valid
    tokens of the whole minibatch) and `total_seqs`, the loss is scaled to this chunk's
    share of the minibatch loss (`common.accumulation_scale`), for accumulation.
    `dropout_rng`: LoRA adapter dropout on (`common.dropout_key`; None: off). The last term
    only when the batch has guide rows and `cfg.guide_coef` > 0: `guide.guide_loss`, the
    token-mean NLL of the failed prompts' reference completions, over `guide_tokens` (the
    minibatch's guide tokens) when given.

    Returns: `(loss, metrics)`; metrics are unscaled: `loss`, `policy_loss`, `clipfrac`,
    `approx_kl`, `ratio_mean/min/max`, `entropy`, and `kl/mean` when the batch has reference
    log-probs (β > 0 or `track_kl`), `logp_mismatch`
    (max |logp − sampler_logp|) and the off-policy correction's `is_weight_mean`,
    `is_weight_max`, `is_frac_truncated`, `mismatch_kl`, `max_abs_logp_diff` (of `old_logp`,
    the proximal policy, against the sampler's; not with `correction.bypass`) when the batch
    has sampler log-probs, `guide/nll` with guide rows. With `cfg.correction.mode` other
    than "none" each token's policy-gradient term is weighted by `offpolicy.correction`'s
    importance weight.
    """
    p = batch.sequences.shape[1] - batch.response_mask.shape[1]
    mask = batch.response_mask.astype(bool)
    logp, ent, _ = common.response_logprobs(model, params, batch.sequences, batch.attention_mask, p,
                                            temperature=cfg.sampling.temperature, with_entropy=True,
                                            group_size=group_size, dropout_rng=dropout_rng)
    old_logp = jax.lax.stop_gradient(logp) if batch.old_logp is None else batch.old_logp
    is_weights, is_metrics = None, {}
    if batch.sampler_logp is not None and not cfg.correction.bypass:  # π_prox = old_logp against μ = the sampler
        behaviour = batch.sampler_logp if batch.behaviour_logp is None else batch.behaviour_logp
        is_weights, is_metrics = offpolicy.correction(cfg.correction, old_logp, behaviour, mask)
    ratio_logp = importance_logp(logp, old_logp, mask, level=cfg.ratio_level)
    pg_loss, pg = policy_term(ratio_logp, old_logp, batch.advantages, mask, cfg, is_weights)
    loss = pg_loss
    metrics = dict(pg, **is_metrics, policy_loss=pg_loss, entropy=ops.masked_mean(jax.lax.stop_gradient(ent), mask))
    if cfg.beta > 0 and batch.ref_logp is None:
        raise ValueError("GRPO loss: beta > 0 needs ref_logp (a reference model)")
    if batch.ref_logp is not None:
        kl_BxT = ops.kl(logp, batch.ref_logp, estimator=cfg.kl_estimator)
        if cfg.beta > 0 and cfg.kl_in == "loss":
            beta = cfg.beta if beta is None else beta
            loss = loss + kl_terms.loss_term(kl_BxT, mask, beta, agg=cfg.agg, norm_len=cfg.loss_norm_len)
        metrics["kl/mean"] = ops.masked_mean(jax.lax.stop_gradient(kl_BxT), mask)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * ops.aggregate(ent, mask, mode=cfg.agg, norm_len=cfg.loss_norm_len)
    if batch.sampler_logp is not None:
        gap = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp) - batch.sampler_logp), 0.0)
        metrics["logp_mismatch"] = jnp.max(gap)
    unscaled = loss
    if total_tokens is not None:
        seqs = batch.response_mask.shape[0] if total_seqs is None else total_seqs
        loss = loss * common.accumulation_scale(mask, mode=cfg.agg, total_tokens=total_tokens, total_seqs=seqs)
    if cfg.guide_coef > 0 and batch.guide_mask is not None:
        g_loss, metrics["guide/nll"] = guide.guide_loss(
            model, params, batch.sequences[:, :p], batch.attention_mask[:, :p], batch.guide_ids, batch.guide_mask,
            total_tokens=guide_tokens, group_size=group_size, dropout_rng=dropout_rng)
        loss = loss + cfg.guide_coef * g_loss
        unscaled = unscaled + cfg.guide_coef * metrics["guide/nll"]
    metrics["loss"] = jax.lax.stop_gradient(unscaled)
    return loss, metrics


# --------------------------------------------------------------------------- update

def update(state: GRPOState, batch: Batch, rng: jax.Array, *, model: Transformer,
           tx: optax.GradientTransformation, cfg: GRPOConfig) -> tuple[GRPOState, dict]:
    """μ passes × `num_minibatches` optimizer steps on one rollout batch, in one `lax.scan`,
    with the state's β (`current_beta`).

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
        guide_tokens = None if mb.guide_mask is None else jnp.sum(mb.guide_mask, dtype=jnp.float32)
        chunk_loss = functools.partial(_chunk_loss, cfg=cfg, model=model, total_tokens=total_tokens,
                                       guide_tokens=guide_tokens,
                                       total_seqs=common.nonempty_rows(mb.response_mask),  # dropped rows: none
                                       group_size=cfg.prompt_group(mb_size // k, shuffled=m > 1),
                                       beta=current_beta(state, cfg),
                                       dropout=functools.partial(common.dropout_key, model.config, rng, policy.step))
        loss, metrics, grads = common.accumulate_gradients(chunk_loss, policy.params, mb, num_microbatches=k)
        policy, finite = common.apply_if_finite(policy, grads, tx, loss)
        return policy, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), finite=finite)

    # One minibatch: the whole batch each pass, unshuffled.
    policy, stacked = common.minibatch_scan(step, state.policy, batch, rng, passes=mu, minibatches=m, shuffle=m > 1)
    metrics = common.summarize_steps(stacked, skipped="skipped_steps",
                                     first={f"first/{name}": name for name in ("ratio_max", "ratio_min", "approx_kl")})
    return state.replace(policy=policy), metrics


def _chunk_loss(params, chunk, index, *, cfg, model, total_tokens, guide_tokens, total_seqs, group_size, beta,
                dropout):
    return loss_fn(params, chunk, cfg, model=model, total_tokens=total_tokens, total_seqs=total_seqs,
                   group_size=group_size, beta=beta, dropout_rng=dropout(index), guide_tokens=guide_tokens)


# --------------------------------------------------------------------------- iteration


def _fill_unscored(scores: jax.Array, scored: jax.Array, g: int) -> jax.Array:
    """`scores` `[N]` with each unscored row's replaced by its group's first scored row's
    (unchanged in a group with none), so a group's max and min are its scored rows'."""
    s, m = scores.reshape(-1, g), scored.reshape(-1, g)
    first = jnp.take_along_axis(s, jnp.argmax(m, axis=1)[:, None], axis=1)
    return jnp.where(m, s, first).reshape(-1)


def rollout(state: GRPOState, prompt_ids, prompt_mask, rng, *, model: Transformer, cfg: GRPOConfig) -> SampleOutput:
    """Samples G responses per prompt: a `SampleOutput` of `N = B·G` rows, a prompt's
    samples contiguous."""
    key = jax.random.fold_in(jax.random.fold_in(rng, state.step), 0)
    return sample_responses(model, state.policy.params, prompt_ids, prompt_mask, key, cfg.sampling)


def score(state: GRPOState, out: SampleOutput, extras, host_scores: dict, rng, *, model: Transformer,
          cfg: GRPOConfig, reward: rewards_lib.Reward) -> tuple[Batch, dict]:
    """The reward's JAX components on `out` (given the prompts' `extras`, `[B, ...]`
    arrays, repeated per sample) beside its host ones' `host_scores` (`{name: [N]}`), then
    (overlong penalty) → (dynamic selection) → old/ref log-probs → (KL in the reward,
    `kl_terms.sequence_reward`) → advantages: the update's `Batch` and the rollout's metrics.
    An estimator of `advantages.PER_COMPONENT` ("gdpo") gets the reward's components
    (`reward_components`), the shaping (overlong penalty, KL in the reward) as one more of
    weight 1 when there is any.
    With `guide_coef` > 0 the extras must hold `guide.GUIDE_KEYS`: the batch then carries the
    references of the (kept) groups whose best total score is below `guide_below`
    (`guide/failed_fraction` in the metrics).

    A row that every weighted reward leaves unscored (a host reward's None,
    `Reward.scored`) is dropped: response mask 0 in the batch (no loss term, no token in any
    aggregation), out of its group's baseline (`compute_advantages(..., scored=)`), its
    group's dynamic selection and `reward/mean`; `reward/dropped` counts them."""
    del rng
    g = cfg.group_size
    n_pool = out.response_ids.shape[0]
    if cfg.guide_coef > 0 and not all(k in (extras or {}) for k in guide.GUIDE_KEYS):
        raise ValueError(f"GRPO with guide_coef={cfg.guide_coef} needs each prompt's reference completion: extras "
                         f"{guide.GUIDE_KEYS} (right-padded ids and mask), got extras {tuple(extras or ())}")
    if cfg.uses_reference and reference_params(state) is None:
        raise ValueError(f"GRPO with beta={cfg.beta}, track_kl={cfg.track_kl} needs a reference model: "
                         "init_state(params, tx, ref_params=...), or LoRA adapters on the policy")
    beta = current_beta(state, cfg)
    extras_N = scoring.repeat_extras(extras, g, n_pool // g)
    scores = {**reward.device_scores(rewards_lib.RewardInput.from_sample(out), extras_N, state.reward_params),
              **host_scores}
    total = reward.total(scores)
    scored = None if reward.is_jax else reward.scored(scores)  # only a host reward leaves rows unscored
    per_component = cfg.advantage in advantages.PER_COMPONENT
    comps_NxK, weights_K = reward_components(reward, scores) if per_component else (None, None)
    lengths = out.response_mask.sum(axis=1)
    metrics = dict(reward.metrics(scores))
    metrics.update({"reward/mean": jnp.mean(total, where=scored), "reward/std": jnp.std(total, where=scored),
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
        sel = select_groups(shaped if scored is None else _fill_unscored(shaped, scored, g), g, k)
        out = jax.tree.map(lambda x: x[sel.indices], out)
        scored = None if scored is None else scored[sel.indices]
        shaped = shaped[sel.indices]
        total = total[sel.indices]
        comps_NxK = None if comps_NxK is None else comps_NxK[sel.indices]
        extras_N = {k: v[sel.indices] for k, v in extras_N.items()}
        metrics.update({"dynamic/kept_fraction": sel.kept_fraction, "dynamic/signal_fraction": sel.signal_fraction})
    mask = out.response_mask
    n = mask.shape[0]
    p = out.sequences.shape[1] - mask.shape[1]
    forward = functools.partial(score_responses, model, sequences=out.sequences, attention_mask=out.attention_mask,
                                prompt_len=p, temperature=cfg.sampling.temperature, group_size=cfg.prompt_group(n))
    if cfg.correction.bypass:  # the sampler's (behaviour) log-probs are old_logp: no proximal forward pass
        old_logp = out.behaviour
    else:
        old_logp = None if cfg.reuses_rollout_logp else forward(state.policy.params)
    ref_logp = forward(reference_params(state)) if cfg.uses_reference else None
    kl_N = None
    if ref_logp is not None and (cfg.kl_in == "reward" or cfg.kl_config.adaptive):
        rollout_logp = forward(state.policy.params) if old_logp is None else old_logp
        kl_NxT = ops.kl(rollout_logp, ref_logp, estimator=cfg.kl_estimator)
        if cfg.kl_in == "reward" and cfg.beta > 0:
            shaped = kl_terms.sequence_reward(shaped, kl_NxT, mask, beta)
        kl_N = kl_terms.sequence_kl(kl_NxT, mask)
        metrics["kl/seq"] = jnp.mean(kl_N)
        kl_N = kl_N if cfg.kl_config.adaptive else None
    if scored is not None:
        metrics["reward/dropped"] = jnp.sum(~scored)
        mask = mask * scored[:, None].astype(mask.dtype)
    components = None
    if per_component:
        if cfg.overlong_max_len is not None or (cfg.kl_in == "reward" and cfg.beta > 0):
            # the score's shaping (overlong penalty, KL in the reward) as one more component, weight 1
            comps_NxK = jnp.concatenate([comps_NxK, (shaped - total)[:, None]], axis=1)
            weights_K = jnp.concatenate([weights_K, jnp.ones((1,), jnp.float32)])
        components = (comps_NxK, weights_K)
    adv = compute_advantages(shaped, cfg, mask, scored=scored, components=components)
    if cfg.dynamic_sampling:
        adv = jnp.where(jnp.repeat(sel.has_signal, g)[:, None], adv, 0.0)
    zero_group = jnp.all((adv == 0).reshape(n // g, -1), axis=1)  # n = K·G always
    var = ops.masked_var(adv, mask)
    metrics.update({"advantage/mean": ops.masked_mean(adv, mask), "advantage/std": jnp.sqrt(var),
                    "advantage/zero_group_fraction": jnp.mean(zero_group.astype(jnp.float32))})
    guide_ids = guide_mask = None
    if cfg.guide_coef > 0:
        failed_K = guide.failed_groups(total, g, below=cfg.guide_below)
        guide_ids, guide_mask = guide.guide_rows(extras_N["reference_ids"], extras_N["reference_mask"], failed_K, g)
        metrics.update({"guide/failed_fraction": jnp.mean(failed_K.astype(jnp.float32)),
                        "guide/tokens": jnp.sum(guide_mask)})
    return Batch(out.sequences, out.attention_mask, mask, adv, old_logp, ref_logp, out.logprobs, kl_N, guide_ids,
                 guide_mask, out.behaviour_logprobs), metrics


def train(state: GRPOState, batch: Batch, rng, *, model: Transformer, tx: optax.GradientTransformation,
          cfg: GRPOConfig, schedule: Callable | None = None) -> tuple[GRPOState, dict]:
    """`update` on the scored batch with the iteration's update key, then the step count and
    (with a `kl_target`) β's controller step on the batch's measured KL (`beta`, the β
    used, and `beta_next` in the metrics); `lr` in the metrics when given the `schedule`."""
    metrics = {} if schedule is None else {"lr": jnp.asarray(schedule(state.policy.step), jnp.float32)}
    key = jax.random.fold_in(jax.random.fold_in(rng, state.step), 1)
    state, upd = update(state, batch, key, model=model, tx=tx, cfg=cfg)
    if cfg.kl_config.adaptive:
        kl_ctl = kl_controller.update(state.kl_ctl, jnp.mean(batch.kl_N), batch.kl_N.shape[0], cfg=cfg.kl_config)
        metrics.update(beta=state.kl_ctl.beta, beta_next=kl_ctl.beta)
        state = state.replace(kl_ctl=kl_ctl)
    return state.replace(step=state.step + 1), {**metrics, **upd}


def split(model: Transformer, tx: optax.GradientTransformation, cfg: GRPOConfig, reward, *,
          schedule: Callable | None = None) -> timing.Split:
    """The iteration as `timing.Split(rollout, score, train)` (pure functions, not jitted):
    `make_iteration` and the command line's sharded step (`runs.phases`) jit them."""
    reward = rewards_lib.as_reward(reward)
    advantages.check_reward(cfg.advantage, reward)
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
        return lambda out: scoring.host_scores(reward, jax.device_get(out), extras, g, eos_id=cfg.sampling.eos_id,
                                               drop_unscored=True)

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


__all__ = ["ADVANTAGES", "RATIO_LEVELS", "Batch", "GRPOConfig", "GRPOState", "GroupSelection", "compute_advantages",
           "current_beta", "importance_logp", "init_state", "loss_fn", "make_iteration", "overlong_penalty", "policy_term",
           "preset", "reward_components", "rollout", "score", "select_groups", "split", "train", "update"]
