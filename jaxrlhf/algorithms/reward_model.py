"""Reward modelling: Bradley–Terry on preference pairs with a "score"-head transformer.

A batch is a `data.preference_batch` (the same layout as DPO's, without reference columns):

    prompt_ids, prompt_mask        [B, P]  left-padded prompts
    chosen_ids, chosen_mask        [B, T]  right-padded preferred responses (EOS included)
    rejected_ids, rejected_mask    [B, T]  right-padded other responses
    margin                         [B]     optional: required score gap per pair

The score of a sequence is the score head's scalar at the last valid token of
prompt ⧺ response (`models.score_at_last_token`); chosen and rejected go through one
forward pass of `2B` rows; the loss is `ops.reward_model_loss` = mean of
`−log σ(s_c − s_r − margin)` (docs/concepts.md#preference-losses).

    model, params = init_from_policy(policy_model, policy_params)   # trunk copied, new head
    state = init_state(params, tx)
    step = jax.jit(make_train_step(model, tx, RewardModelConfig()), donate_argnums=0)
    reward = score_fn(model, state.params)       # (sequences, attention_mask) -> [N]
    reward = as_reward(model)                    # a rewards.Reward, params given at call time (PPO)

An ensemble of K reward models (members trained alike from different head inits and batch
orders) is one stacked pytree, every leaf `[K, ...]` (`stack_members`); `ensemble_scores`
scores all members in one vmapped pass and reduces them ("mean" or "min"):

    params_K = stack_members([params_0, params_1, params_2])
    reward = as_ensemble_reward(model, reduce="min")     # + its disagreement, weight 0
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops, rewards
from jaxrlhf.algorithms import common
from jaxrlhf.algorithms.dpo import PAIR_KEYS, check_pairs, pair_sequences
from jaxrlhf.models.transformer import Transformer, score_at_last_token
from jaxrlhf.options import check, option

PyTree = Any
Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Bradley–Terry reward-model training (each field's doc and bounds on the field)."""

    use_margin: bool = option(False, "subtract batch['margin'] [B] inside the sigmoid (Llama-2 style); the batch must "
                              "then carry it", cli=False)
    num_microbatches: int = option(1, "gradient accumulation steps per batch; must divide the batch (the loss is a "
                                   "mean over pairs, reproduced exactly)", min=1)

    def __post_init__(self):
        check(self)


def _check_batch(batch: Batch, cfg: RewardModelConfig) -> None:
    check_pairs(batch, with_reference=False, num_microbatches=cfg.num_microbatches)
    if cfg.use_margin:
        b = batch["prompt_ids"].shape[0]
        if "margin" not in batch:
            raise ValueError("RewardModelConfig.use_margin=True but the batch has no 'margin' [B]")
        if batch["margin"].shape != (b,):
            raise ValueError(f"reward-model batch: margin must be [B] = ({b},), got {batch['margin'].shape}")


def _check_score_model(model: Transformer) -> None:
    if model.head != "score":
        raise ValueError(f"a reward model needs a Transformer with head='score', got head={model.head!r} "
                         "(see init_from_policy)")


def init_from_policy(policy_model: Transformer, policy_params: PyTree, *, seed: int = 0,
                     head_std: float = 0.02, copy: bool = True) -> tuple[Transformer, PyTree]:
    """A reward model on a policy's trunk: `(Transformer(config, "score"), params)`.

    Every trunk tensor (embeddings, layers, final norm) is copied (with `copy=False`
    shared: for a frozen LoRA trunk, whose train state never donates it); the LM and value
    heads are dropped and a new `score` head `[D, 1]` is drawn from N(0, head_std²) with
    `seed`. From a Hugging Face causal-LM folder, `models.load_pretrained(path,
    head="score")` does the same in one call.
    """
    trunk = {k: v for k, v in policy_params.items() if k not in ("lm_head", "value_head", "score")}
    d = policy_model.config.hidden_size
    dtype = jnp.dtype(policy_model.config.param_dtype)
    kernel = head_std * jax.random.normal(jax.random.key(seed), (d, 1), jnp.float32)
    params = dict(trunk, score={"kernel": kernel.astype(dtype)})
    return Transformer(policy_model.config, head="score"), jax.tree.map(jnp.array, params) if copy else params


def init_state(params: PyTree, tx: optax.GradientTransformation) -> common.TrainState:
    return common.TrainState.create(params, tx)


def score(model: Transformer, params, sequences_NxL: jax.Array, attention_mask_NxL: jax.Array, *,
          dropout_rng: jax.Array | None = None) -> jax.Array:
    """Scores `[N]` float32: the score head at the last valid token of each row.

    Rows may be left-padded (prompt) and right-padded (response) at once. `dropout_rng`:
    LoRA adapter dropout on (training only, `common.dropout_key`); None: off.
    """
    _check_score_model(model)
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    out = model.apply({"params": params}, sequences_NxL, attention_mask_NxL, rngs=rngs)
    return score_at_last_token(out.values, attention_mask_NxL)


def score_fn(model: Transformer, params) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`fn(sequences [N, L], attention_mask [N, L]) -> scores [N]`, jittable, for PPO.

    The params are closed over (a frozen reward model). Under `jit` they become constants
    of the compiled function; to share one compilation across parameter values, jit
    `functools.partial(score, model)` instead and pass the params.
    """
    _check_score_model(model)

    def fn(sequences_NxL, attention_mask_NxL):
        return score(model, params, sequences_NxL, attention_mask_NxL)

    return fn


def as_reward(model: Transformer, *, name: str = "reward_model", weight: float = 1.0) -> rewards.Reward:
    """The reward model as a `rewards.Reward` (one "model" component, `score` without
    gradient) whose parameters are given at call time: `reward.device_scores(inputs,
    extras, params)`. PPO keeps them frozen in `PPOState.reward_params`, an argument of its
    compiled iteration, never a constant baked into it."""
    _check_score_model(model)

    def fn(params, sequences_NxL, attention_mask_NxL):
        return score(model, jax.lax.stop_gradient(params), sequences_NxL, attention_mask_NxL)

    return rewards.model_reward(fn, name=name, weight=weight, takes_params=True, vocab_size=model.config.vocab_size)


ENSEMBLE_REDUCES = ("mean", "min")


def check_reduce(reduce: str, field: str = "reward_model.ensemble_reduce") -> str:
    """`reduce` if it is one of `ENSEMBLE_REDUCES`, else a ValueError naming `field`."""
    if reduce not in ENSEMBLE_REDUCES:
        raise ValueError(f"{field}={reduce!r}; expected one of {ENSEMBLE_REDUCES} (how the members' scores of a "
                         "reward-model ensemble combine)")
    return reduce


def stack_members(members: list[PyTree]) -> PyTree:
    """K reward models' params (one structure) as one pytree, every leaf `[K, ...]`."""
    if not members:
        raise ValueError("stack_members needs at least one member")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *members)


def member_scores(model: Transformer, params_K, sequences_NxL: jax.Array, attention_mask_NxL: jax.Array
                  ) -> jax.Array:
    """`[K, N]` scores of every member of a stacked ensemble (`stack_members`), one vmapped pass."""
    return jax.vmap(lambda p: score(model, p, sequences_NxL, attention_mask_NxL))(params_K)


def reduce_members(scores_KxN: jax.Array, reduce: str) -> jax.Array:
    """The ensemble's score `[N]`: "mean", r = (1/K) Σ_k s_k, or "min", r = min_k s_k, the
    conservative choice against reward over-optimisation (Coste et al. 2023, "Reward Model
    Ensembles Help Mitigate Overoptimization": worst-case optimisation)."""
    check_reduce(reduce, "reduce")
    return jnp.mean(scores_KxN, axis=0) if reduce == "mean" else jnp.min(scores_KxN, axis=0)


def ensemble_scores(model: Transformer, params_K, sequences_NxL: jax.Array, attention_mask_NxL: jax.Array, *,
                    reduce: str) -> jax.Array:
    """`reduce_members(member_scores(...), reduce)`: `[N]`."""
    return reduce_members(member_scores(model, params_K, sequences_NxL, attention_mask_NxL), reduce)


def as_ensemble_reward(model: Transformer, *, reduce: str, name: str = "reward_model",
                       weight: float = 1.0) -> rewards.Reward:
    """A stacked ensemble (`stack_members`) as a `rewards.Reward`, params given at call
    time: component `name` = the members' scores reduced (`reduce_members`) at `weight`,
    and `<name>_std` = their standard deviation over members (the disagreement) at weight
    0, logged (`reward/<name>_std`) but not optimised."""
    _check_score_model(model)
    check_reduce(reduce, "reduce")

    def reduced(params, sequences_NxL, attention_mask_NxL):
        return ensemble_scores(model, jax.lax.stop_gradient(params), sequences_NxL, attention_mask_NxL,
                               reduce=reduce)

    def spread(params, sequences_NxL, attention_mask_NxL):
        return jnp.std(member_scores(model, jax.lax.stop_gradient(params), sequences_NxL, attention_mask_NxL),
                       axis=0)

    vocab = model.config.vocab_size
    return rewards.combine([
        (1.0, rewards.model_reward(reduced, name=name, weight=weight, takes_params=True, vocab_size=vocab)),
        (1.0, rewards.model_reward(spread, name=f"{name}_std", weight=0.0, takes_params=True, vocab_size=vocab))])


def pair_scores(model: Transformer, params, batch: Batch, *, dropout_rng: jax.Array | None = None,
                reduce: str | None = None) -> tuple[jax.Array, jax.Array]:
    """`(chosen [B], rejected [B])` scores from one forward pass of `2B` rows; with `reduce`
    the params are a stacked ensemble and the scores its reduced ones (`ensemble_scores`)."""
    sequences, attention_mask, _, _ = pair_sequences(batch)
    if reduce is not None:
        scores_2B = ensemble_scores(model, params, sequences, attention_mask, reduce=reduce)
    else:
        scores_2B = score(model, params, sequences, attention_mask, dropout_rng=dropout_rng)
    b = batch["prompt_ids"].shape[0]
    return scores_2B[:b], scores_2B[b:]


def loss_fn(params, batch: Batch, *, model: Transformer, cfg: RewardModelConfig,
            dropout_rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """`ops.reward_model_loss` of the pair scores. Metrics (means over pairs): `accuracy`
    (s_c > s_r), `score_gap`, `chosen_score`, `rejected_score`. `dropout_rng`: LoRA adapter
    dropout on."""
    chosen, rejected = pair_scores(model, params, batch, dropout_rng=dropout_rng)
    loss, metrics = ops.reward_model_loss(chosen, rejected, margin=batch["margin"] if cfg.use_margin else None)
    metrics = dict(metrics, chosen_score=jnp.mean(jax.lax.stop_gradient(chosen)),
                   rejected_score=jnp.mean(jax.lax.stop_gradient(rejected)))
    return loss, metrics


def make_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: RewardModelConfig
                    ) -> Callable[[common.TrainState, Batch, jax.Array], tuple[common.TrainState, dict]]:
    """`step(state, batch, rng) -> (state, metrics)`, a pure function (not jitted).

    Jit it yourself, e.g. `jax.jit(step, donate_argnums=0)` (or `jit_train_step`); `rng`
    draws the LoRA adapter-dropout masks (`common.dropout_key`; unused without). Metrics:
    those of `loss_fn` (averaged over micro-batches), `loss`, `grad_norm` (before clipping)
    and `finite`; when `finite` is False the update is skipped.
    """
    _check_score_model(model)
    keys = PAIR_KEYS + (("margin",) if cfg.use_margin else ())
    return common.make_row_mean_step(functools.partial(loss_fn, model=model, cfg=cfg), tx, keys=keys,
                                     num_microbatches=cfg.num_microbatches, model_config=model.config,
                                     check=lambda batch: _check_batch(batch, cfg))


def jit_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: RewardModelConfig):
    """`jax.jit(make_train_step(...), donate_argnums=0)`: the state's buffers are reused."""
    return jax.jit(make_train_step(model, tx, cfg), donate_argnums=0)


def make_eval_step(model: Transformer, cfg: RewardModelConfig, *, reduce: str | None = None
                   ) -> Callable[[PyTree, Batch], dict]:
    """`eval_step(params, batch) -> metrics` (pure; jit it) on held-out pairs; with `reduce`
    of a stacked ensemble's params, scored by its reduced score (`ensemble_scores`).

    Metrics are means over pairs weighted by `batch["weight"]` `[B]` (optional, default
    ones; zero it for padding rows), plus `weight` = Σ weights: `loss`, `accuracy`
    (s_c > s_r), `score_gap`, `chosen_score`, `rejected_score`.
    """
    _check_score_model(model)

    def eval_step(params, batch: Batch) -> dict:
        _check_batch(batch, cfg)
        chosen, rejected = pair_scores(model, params, batch, reduce=reduce)
        margin = batch["margin"] if cfg.use_margin else jnp.zeros_like(chosen)
        loss_B, metrics_B = jax.vmap(lambda c, r, m: ops.reward_model_loss(c[None], r[None], margin=m[None]))(
            chosen, rejected, margin)
        weight_B = jnp.asarray(batch.get("weight", jnp.ones_like(loss_B)), jnp.float32)
        total = jnp.sum(weight_B)

        def mean(x):
            return jnp.sum(weight_B * x) / jnp.maximum(total, 1e-12)

        return dict(loss=mean(loss_B), weight=total, chosen_score=mean(chosen), rejected_score=mean(rejected),
                    **{k: mean(v) for k, v in metrics_B.items()})

    return eval_step

