"""Pieces every algorithm shares: train state, optimizer, response-aligned forward passes,
and gradient accumulation that never changes the loss normalisation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops
from jaxrlhf.options import check, option
from jaxrlhf.models import lora
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import Transformer, init_cache, lm_head_weight, project_logits

PyTree = Any

SCHEDULES = ("constant", "linear", "cosine")


@flax.struct.dataclass
class TrainState:
    """A trained model's parameters and optimizer state, plus the global step.

    With LoRA adapters in `params` (`models.lora`) only they are trained: the optimizer
    state covers `lora.trainable(params)`, gradients are shaped like it, and the base
    params pass through every update unchanged.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(lora.trainable(params)))

    def apply_gradients(self, grads, tx: optax.GradientTransformation) -> "TrainState":
        """One optimizer step; `grads` are shaped like `lora.trainable(self.params)`."""
        trained = lora.trainable(self.params)
        updates, opt_state = tx.update(grads, self.opt_state, trained)
        params = lora.with_trainable(self.params, optax.apply_updates(trained, updates))
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with an optional warmup and decay schedule and global-norm clipping."""

    lr: float = option(1e-5, "peak learning rate", min=0, safe=True)
    schedule: str = option("constant", "after the warmup: 'constant', or 'linear' / 'cosine' decay to "
                           "end_lr_ratio × lr over the schedule's span", choices=SCHEDULES)
    warmup_steps: int = option(0, "linear warmup from 0, in optimizer steps", min=0)
    decay_steps: int | None = option(None, "the schedule's span in optimizer steps (warmup included); None: the "
                                     "phase's own length (`total_steps`). A phase may stop part-way through a "
                                     "longer schedule", min=1)
    total_steps: int = option(1, "the optimizer steps of the phase (a PPO iteration makes epochs × minibatches "
                              "of them, a GRPO one μ × minibatches): the span when decay_steps is None",
                              min=1, cli=False)
    end_lr_ratio: float = option(0.0, "the decayed rate as a fraction of lr", min=0, max=1)
    b1: float = option(0.9, "Adam's β1", min=0, below=1)
    b2: float = option(0.999, "Adam's β2", min=0, below=1)
    eps: float = option(1e-8, "Adam's ε", above=0)
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW)", min=0)
    max_grad_norm: float | None = option(1.0, "clip the gradients' global norm to this; None: no clipping",
                                         above=0)

    def __post_init__(self):
        check(self)

    @property
    def span(self) -> int:
        """The schedule's length in optimizer steps: `decay_steps`, or `total_steps`."""
        return self.total_steps if self.decay_steps is None else self.decay_steps


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    decay_steps = max(cfg.span - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(cfg.lr, cfg.lr * cfg.end_lr_ratio, decay_steps)
    else:
        main = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.end_lr_ratio)
    if cfg.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), main],
                                [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, learning-rate schedule); the schedule is returned for logging."""
    schedule = make_schedule(cfg)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw), schedule


def dropout_key(config: ModelConfig, rng: jax.Array, step: jax.Array, index: jax.Array, role: int = 0
                ) -> jax.Array | None:
    """The LoRA adapter-dropout key of micro-batch `index` of optimizer step `step` (fresh
    masks every step and micro-batch; `role` sets apart models trained in one step, PPO's
    actor 0 and critic 1, whose layers have the same names), or None when `config` has no
    adapter dropout (`lora.dropout = 0`): nothing is then threaded into the model and the
    compiled training step is the one without dropout."""
    if config.lora is None or config.lora.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, step), index), role)


def _dropout_rngs(dropout_rng: jax.Array | None, part: int = 0) -> dict | None:
    """`model.apply`'s `rngs` for adapter dropout: None (off) or `{"dropout": key}`, the
    key folded with `part` where one forward pass applies the model more than once."""
    return None if dropout_rng is None else {"dropout": jax.random.fold_in(dropout_rng, part)}


def response_hidden(model: Transformer, params, sequences_BxL, attention_mask_BxL, prompt_len: int, *,
                    group_size: int = 1, dropout_rng: jax.Array | None = None):
    """Hidden states (and scalar-head values) aligned with the response tokens.

    Response token `t` sits at `P + t`; the state that predicts it (its logits, and the
    critic's `V_t`, docs/concepts.md#advantages-token-level-or-sequence-level) is at
    `P + t − 1`. Returns `(hidden [B, T, D], values [B, T] or None)`.

    `group_size = G > 1` declares that rows come in groups of G consecutive rows with the
    same prompt (the layout of `num_samples = G` rollouts): each prompt then runs once and
    its G responses attend to its keys and values (`shared_prompt_hidden`), the same
    numbers up to float rounding with `(P + T)·G → P + T·G` tokens through the layers.

    `dropout_rng`: a training loss's `dropout_key`, turning LoRA adapter dropout on (None:
    off, as in sampling, scoring and the reference).
    """
    if group_size > 1:
        b = sequences_BxL.shape[0]
        if b % group_size:
            raise ValueError(f"response_hidden: {b} rows do not split into groups of group_size={group_size}")
        p = prompt_len
        return shared_prompt_hidden(
            model, params, sequences_BxL[::group_size, :p], attention_mask_BxL[::group_size, :p],
            sequences_BxL[:, p:], attention_mask_BxL[:, p:], expand=lambda x: jnp.repeat(x, group_size, axis=0),
            dropout_rng=dropout_rng)
    out = model.apply({"params": params}, sequences_BxL, attention_mask_BxL, compute_logits=False,
                      rngs=_dropout_rngs(dropout_rng))
    hidden = out.hidden[:, prompt_len - 1:-1]
    values = None if out.values is None else out.values[:, prompt_len - 1:-1]
    return hidden, values


def shared_prompt_hidden(model: Transformer, params, prompt_ids_BxP, prompt_mask_BxP, response_ids_NxT,
                         response_mask_NxT, *, expand: Callable[[jax.Array], jax.Array],
                         dropout_rng: jax.Array | None = None):
    """`response_hidden` for N responses to B < N prompts, running each prompt once.

    The prompts (left-padded) fill the first P slots of a KV cache; `expand` maps any
    `[B, ...]` prompt-side array to the N response rows (`jnp.repeat(x, G, 0)` for groups
    of G, `jnp.concatenate([x, x])` for DPO's chosen-then-rejected rows); the responses then
    run on the expanded cache. Differentiable like the plain forward pass. `dropout_rng`:
    adapter dropout on, as in `response_hidden` (the prompt and response passes draw
    different masks).

    Returns `(hidden [N, T, D], values [N, T] or None)`, aligned as in `response_hidden`.
    """
    b, p = prompt_ids_BxP.shape
    t = response_ids_NxT.shape[1]
    apply = functools.partial(model.apply, {"params": params}, compute_logits=False)
    prompt_mask_BxP = prompt_mask_BxP.astype(bool)
    slots_BxS = jnp.concatenate([prompt_mask_BxP, jnp.zeros((b, t), bool)], axis=1)
    pre = apply(prompt_ids_BxP, slots_BxS, cache=init_cache(model.config, b, p + t), cache_index=0,
                rngs=_dropout_rngs(dropout_rng, 0))
    attn_NxS = jnp.concatenate([expand(prompt_mask_BxP), response_mask_NxT.astype(bool)], axis=1)
    out = apply(response_ids_NxT, attn_NxS, cache=jax.tree.map(expand, pre.cache), cache_index=p,
                rngs=_dropout_rngs(dropout_rng, 1))
    # The last prompt token's state predicts response token 0.
    hidden = jnp.concatenate([expand(pre.hidden[:, -1:]), out.hidden[:, :-1]], axis=1)
    values = None
    if out.values is not None:
        values = jnp.concatenate([expand(pre.values[:, -1:]), out.values[:, :-1]], axis=1)
    return hidden, values


def response_logprobs(
    model: Transformer,
    params,
    sequences_BxL: jax.Array,
    attention_mask_BxL: jax.Array,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group_size: int = 1,
    dropout_rng: jax.Array | None = None,
):
    """Per-token log-probs (and entropy) of the response part of `sequences`.

    Args:
      sequences_BxL: prompt ⧺ response, `L = P + T`, prompt left-padded.
      attention_mask_BxL: 1 on real tokens.
      prompt_len: P (static).
      group_size: G > 1 when rows come in groups of G with the same prompt: each prompt
        runs once (see `response_hidden`).
      dropout_rng: LoRA adapter dropout on (a training loss's `dropout_key`); None: off.

    Returns: `(logp [B, T], entropy [B, T] or None, values [B, T] or None)`, float32; the
      LM head is applied only to the `T` response-predicting positions.
    """
    hidden_BxTxD, values = response_hidden(model, params, sequences_BxL, attention_mask_BxL, prompt_len,
                                           group_size=group_size, dropout_rng=dropout_rng)
    logp, ent = hidden_logprobs(model, params, hidden_BxTxD, sequences_BxL[:, prompt_len:],
                                temperature=temperature, with_entropy=with_entropy)
    return logp, ent, values


def hidden_logprobs(model: Transformer, params, hidden_BxTxD, targets_BxT, *, temperature: float = 1.0,
                    with_entropy: bool = False):
    """`(logp [B, T], entropy [B, T] or None)` of `targets` from the states that predict
    them (`response_hidden`), through the LM head (`head_logprobs`)."""
    out = head_logprobs(model.config, params, hidden_BxTxD, targets_BxT, temperature=temperature,
                        with_entropy=with_entropy)
    return out.logp, out.entropy


# `logprobs_head="auto"` fuses the head from this many logits per pass (B·T·V = 2**24, one
# float32 copy 64 MiB, of which the plain path holds several under `grad`). Below it the
# plain path's logits are small; the built-in task's tiny vocabularies always stay there.
# At and above it the fused head costs the same step time (SmolLM2-135M GRPO, 16 × 64
# responses: docs/benchmarks.md) and saves the copies.
CHUNKED_HEAD_FROM = 2**24


def uses_chunked_head(config: ModelConfig, rows: int, positions: int) -> bool:
    """Whether `head_logprobs` fuses the head for `[rows, positions]` targets."""
    if config.logprobs_head == "auto":
        return rows * positions * config.vocab_size >= CHUNKED_HEAD_FROM
    return config.logprobs_head == "chunked"


def head_logprobs(config: ModelConfig, params, hidden_BxTxD, targets_BxT, *, temperature: float = 1.0,
                  with_entropy: bool = False, with_argmax: bool = False) -> ops.LinearLogprobs:
    """Log-probs (and entropies, greedy tokens) of `targets` under the LM head applied to
    `hidden`, by the path `config.logprobs_head` names (`models.config.LOGPROBS_HEADS`).

    "plain": `project_logits` then `ops.token_logprobs` / `ops.entropy` / argmax on the
    `[B, T, V]` logits; "chunked": `ops.linear_logprobs`, which never holds them (nor
    their gradient); "auto": chunked from `CHUNKED_HEAD_FROM` logits per call. Both give
    the same numbers up to float rounding (tests/ops/test_linear_logprobs.py).
    """
    b, t = targets_BxT.shape
    if uses_chunked_head(config, b, t):
        return ops.linear_logprobs(hidden_BxTxD.astype(config.dtype), lm_head_weight(config, params), targets_BxT,
                                   temperature=temperature, with_entropy=with_entropy, with_argmax=with_argmax,
                                   soft_cap=config.final_logit_softcapping)
    logits_BxTxV = project_logits(config, params, hidden_BxTxD)
    logp = ops.token_logprobs(logits_BxTxV, targets_BxT, temperature=temperature)
    ent = ops.entropy(logits_BxTxV, temperature=temperature) if with_entropy else None
    best = jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32) if with_argmax else None
    return ops.LinearLogprobs(logp, ent, best)


def accumulation_scale(mask_BxT: jax.Array, *, mode: str, total_tokens: jax.Array,
                       total_seqs: int | jax.Array) -> jax.Array:
    """The factor that turns a micro-batch's `ops.aggregate` into its share of the full batch's.

    With micro-batches `k` of a batch, `Σ_k scale_k · aggregate(l_k, m_k, mode)` equals
    `aggregate(l, m, mode)` over the whole batch exactly: the token-mean is renormalised by
    token counts, the sequence means by sequence counts (`total_seqs`: the batch's rows, or
    `nonempty_rows` of it, so that a dropped row, all its mask 0, is no sequence at all).
    Summing micro-batch gradients with these weights is thus the full-batch gradient, for
    every aggregation mode.
    """
    if mode == "token-mean":
        return jnp.sum(mask_BxT, dtype=jnp.float32) / jnp.maximum(total_tokens, 1.0)
    if isinstance(total_seqs, int):
        return jnp.float32(mask_BxT.shape[0] / total_seqs)
    return jnp.float32(mask_BxT.shape[0]) / jnp.maximum(jnp.asarray(total_seqs, jnp.float32), 1.0)


def nonempty_rows(mask_BxT: jax.Array) -> jax.Array:
    """The rows of `mask_BxT` with at least one valid token (float32 scalar): the sequences
    of a `seq-mean-*` aggregation when a row dropped from the update (an unscored sample,
    `Reward.scored`) has its whole mask zeroed."""
    return jnp.sum(jnp.any(mask_BxT > 0, axis=1), dtype=jnp.float32)


def split_microbatches(batch: PyTree, num: int) -> PyTree:
    """`[B, ...]` leaves -> `[num, B/num, ...]`, for a `lax.scan` over micro-batches."""
    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {num} micro-batches")
        return x.reshape(num, x.shape[0] // num, *x.shape[1:])
    return jax.tree.map(split, batch)


def metric_reduction(name: str) -> str:
    """How a metric combines over micro-batches or steps: "max", "min" or "mean".

    Extremes must stay extremes (a mean of per-chunk maxima understates the worst ratio):
    names ending in `_max` (and `logp_mismatch`, `max_abs_logp_diff`, maxima by definition)
    are maxed, names ending in `_min` minimised; everything else is averaged.
    """
    if name.endswith("_max") or name in ("logp_mismatch", "max_abs_logp_diff"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


_REDUCERS = {"max": jnp.max, "min": jnp.min, "mean": jnp.mean}


def reduce_metric(name: str, values: jax.Array) -> jax.Array:
    """A metric's per-step values `[S]` combined into one, as `metric_reduction(name)` says."""
    return _REDUCERS[metric_reduction(name)](values)


def accumulate_gradients(
    loss_fn: Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, dict]],
    params: PyTree,
    batch: PyTree,
    *,
    num_microbatches: int,
) -> tuple[jax.Array, dict, PyTree]:
    """Sum of `grad(loss_fn)` over micro-batches (a `lax.scan`, constant memory).

    `loss_fn(params, microbatch, index)` must already weight its loss as its share of the
    full batch (see `accumulation_scale`), so that the sum is the full-batch loss. Metrics
    are averaged over micro-batches, except extremes (`metric_reduction`): `*_max` are
    maxed and `*_min` minimised, so they equal the full batch's.

    With LoRA adapters in `params` the gradient is taken for them alone (the base params
    are a constant of the differentiated function: no base-sized gradient is formed), and
    `grads` is shaped like `lora.trainable(params)`.

    Returns: `(loss, metrics, grads)`.
    """
    full_params, full_loss = params, loss_fn
    loss_fn = lambda trained, mb, index: full_loss(lora.with_trainable(full_params, trained), mb, index)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    params = lora.trainable(full_params)
    if num_microbatches == 1:
        (loss, metrics), grads = grad_fn(params, batch, jnp.int32(0))
        return loss, metrics, grads
    micro = split_microbatches(batch, num_microbatches)
    combine = {"max": jnp.maximum, "min": jnp.minimum, "mean": lambda a, m: a + m / num_microbatches}

    def body(carry, xs):
        loss_acc, metrics_acc, grads_acc = carry
        index, mb = xs
        (loss, metrics), grads = grad_fn(params, mb, index)
        metrics = {k: combine[metric_reduction(k)](metrics_acc[k], v) for k, v in metrics.items()}
        return (loss_acc + loss, metrics, jax.tree.map(jnp.add, grads_acc, grads)), None

    first_mb = jax.tree.map(lambda x: x[0], micro)
    metrics_shape = jax.eval_shape(lambda: loss_fn(params, first_mb, jnp.int32(0))[1])
    start = {"max": -jnp.inf, "min": jnp.inf, "mean": 0}
    init = (jnp.zeros((), jnp.float32),
            {k: jnp.full(s.shape, start[metric_reduction(k)], s.dtype) for k, s in metrics_shape.items()},
            jax.tree.map(jnp.zeros_like, params))
    (loss, metrics, grads), _ = jax.lax.scan(body, init, (jnp.arange(num_microbatches), micro))
    return loss, metrics, grads


def minibatch_scan(step: Callable[[Any, PyTree], tuple[Any, dict]], carry, batch: PyTree, rng: jax.Array, *,
                   passes: int, minibatches: int, shuffle: bool = True) -> tuple[Any, dict]:
    """`passes × minibatches` optimizer steps over the `N` rows of `batch`, one `lax.scan`.

    `step(carry, minibatch) -> (carry, metrics)`. With `shuffle`, each pass draws a fresh
    permutation of the rows (one key of `rng` per pass) and cuts it into `minibatches`
    equal minibatches; without, every step gets the whole batch as it is (one minibatch).

    Returns: `(carry, metrics stacked over the steps)`, the steps in order.
    """
    if not shuffle:
        return jax.lax.scan(lambda c, _: step(c, batch), carry, jnp.zeros((passes, 0), jnp.int32))
    n = jax.tree.leaves(batch)[0].shape[0]
    perms = jax.vmap(lambda key: jax.random.permutation(key, n))(jax.random.split(rng, passes))
    index = perms.reshape(passes * minibatches, n // minibatches)
    return jax.lax.scan(lambda c, idx: step(c, jax.tree.map(lambda x: x[idx], batch)), carry, index)


def summarize_steps(stacked: dict, *, skipped: str, first: dict[str, str]) -> dict:
    """One value per metric of a scan of optimizer steps (`minibatch_scan`): each reduced
    over the steps as `reduce_metric` says, `finite` (True when no update was skipped),
    `skipped` (the name of the count of skipped updates), and `first`: `{name: metric}`
    read at the first step, the first minibatch of the first pass — where the ratio must
    be 1 (a mismatch means the old log-probs do not match the trainer's forward pass)."""
    metrics = {k: reduce_metric(k, v) for k, v in stacked.items() if k != "finite"}
    metrics["finite"] = jnp.all(stacked["finite"])
    metrics[skipped] = jnp.sum(~stacked["finite"]).astype(jnp.int32)
    metrics.update({name: stacked[key][0] for name, key in first.items()})
    return metrics


def make_row_mean_step(
    loss_fn: Callable[..., tuple[jax.Array, dict]],
    tx: optax.GradientTransformation,
    *,
    keys: tuple[str, ...],
    num_microbatches: int,
    model_config: ModelConfig,
    check: Callable[[PyTree], None] | None = None,
):
    """`step(state, batch, rng) -> (state, metrics)` for a loss that is a mean over rows.

    `loss_fn(params, batch, dropout_rng=...) -> (loss, metrics)` (e.g. DPO or Bradley–Terry
    over pairs); `dropout_rng` is `dropout_key(model_config, rng, state.step, micro-batch)`,
    None without adapter dropout. Each
    micro-batch's mean is weighted by its share of the rows, so accumulation reproduces the
    full-batch loss exactly; a non-finite update is skipped (`apply_if_finite`). Only
    `keys` of the batch enter the step; `check(batch)` validates it first. Metrics: those
    of `loss_fn` (averaged over micro-batches), `loss`, `grad_norm`, `finite`.
    """
    def step(state: TrainState, batch: PyTree, rng: jax.Array):
        if check is not None:
            check(batch)
        total_rows = batch[keys[0]].shape[0]

        def micro_loss(params, mb, index):
            loss, metrics = loss_fn(params, mb, dropout_rng=dropout_key(model_config, rng, state.step, index))
            return loss * (mb[keys[0]].shape[0] / total_rows), metrics

        loss, metrics, grads = accumulate_gradients(micro_loss, state.params, {k: batch[k] for k in keys},
                                                    num_microbatches=num_microbatches)
        new_state, finite = apply_if_finite(state, grads, tx, loss)
        return new_state, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), finite=finite)

    return step


def jit_keeping_frozen(fn: Callable, frozen: tuple[str, ...], *, donate: bool = True) -> Callable:
    """`jax.jit(fn)` for `fn(state, *args) -> (state, *outputs)` on a `flax.struct` state
    that donates the trained part of the state (with `donate`) but neither takes ownership
    of nor copies its `frozen` fields (a frozen reference, reward-model parameters): they
    are passed as separate, non-donated arguments and put back into the returned state."""
    cleared = dict.fromkeys(frozen)

    def inner(trainable, kept, *args):
        state, *rest = fn(trainable.replace(**dict(zip(frozen, kept))), *args)
        return (state.replace(**cleared), *rest)

    jitted = jax.jit(inner, donate_argnums=(0,) if donate else ())

    def call(state, *args):
        kept = tuple(getattr(state, name) for name in frozen)
        state, *rest = jitted(state.replace(**cleared), kept, *args)
        return (state.replace(**dict(zip(frozen, kept))), *rest)

    return call


def apply_if_finite(state: TrainState, grads, tx: optax.GradientTransformation, loss,
                    finite: jax.Array | None = None) -> tuple[TrainState, jax.Array]:
    """`(state.apply_gradients(grads, tx), True)`, or `(state, False)` unchanged — params,
    optimizer state and step — when the loss or any gradient is NaN/Inf (or when a given
    `finite` is False), so that the caller can stop before saving anything poisoned.

    The choice is a `lax.cond`, not a select between the new and the old state: with a
    select, every parameter update reads the old Adam moments while the moment update
    overwrites them in place (donated state), so XLA copies both moments first — two extra
    parameter-sized buffers in the step's temp memory (measured: 2× vs 1× the parameter
    size for an Adam step of a donated state).
    """
    if finite is None:
        finite = tree_finite(grads) & jnp.isfinite(loss)
    new = jax.lax.cond(finite, lambda s: s.apply_gradients(grads, tx), lambda s: s, state)
    return new, finite


def tree_finite(tree: PyTree) -> jax.Array:
    """True when every leaf is finite: the check that stops a run before it saves NaNs."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
