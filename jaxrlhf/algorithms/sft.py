"""Supervised fine-tuning: masked cross-entropy on the response tokens only.

A batch is one joined sequence per row (`data.sft_batch`, `data.sft_arrays`):

    tokens      [B, L]  prompt ⧺ response (prompt left-padded, response right-padded)
    input_mask  [B, L]  1 on real tokens (attention)
    loss_mask   [B, L]  1 exactly on the tokens to learn (the response, EOS included)

Token `tokens[:, i]` is predicted by the logits at `i − 1`
(docs/concepts.md#shapes-masks-and-the-one-shift); the shift lives in
`common.response_hidden`. Only positions `i ≥ cfg.prompt_len` can carry loss, and the LM
head is applied to those `L − prompt_len` positions only: with the default `prompt_len=1`
every token after the first may be a target; set it to the (left-padded) prompt width `P`
of prompt/response batches to skip the prompt's logits altogether.

    cfg = SFTConfig()
    state = init_state(params, tx)
    step = jax.jit(make_train_step(model, tx, cfg), donate_argnums=0)
    state, metrics = step(state, batch, rng)      # metrics: loss, token_accuracy, grad_norm, finite, ...
    eval_metrics = jax.jit(make_eval_step(model, cfg))(state.params, held_out_batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops
from jaxrlhf.algorithms import common
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.options import check, option

PyTree = Any
Batch = dict[str, jax.Array]
BATCH_KEYS = ("tokens", "input_mask", "loss_mask")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Masked cross-entropy on the response tokens (each field's doc and bounds on the field)."""

    agg: str = option("token-mean", "how per-token NLLs become the loss (`ops.aggregate`); 'token-mean' weighs every "
                      "response token the same", choices=ops.AGGREGATE_MODES)
    norm_len: int | None = option(None, "the constant L of agg='seq-mean-token-sum-norm' (required there only)", min=1)
    prompt_len: int = option(1, "positions < prompt_len never carry loss and get no logits", min=1, cli=False)
    num_microbatches: int = option(1, "gradient accumulation steps per batch; must divide the batch. Accumulation "
                                   "never changes the loss normalisation", min=1)

    def __post_init__(self):
        check(self)
        if self.agg == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("SFTConfig: agg='seq-mean-token-sum-norm' needs norm_len (an integer >= 1)")


def check_batch(batch: Batch, cfg: SFTConfig) -> None:
    """Raises ValueError for a missing key, mismatched shapes, or a batch that does not split."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"SFT batch is missing {missing}; expected keys {BATCH_KEYS} (see data.sft_batch)")
    shape = batch["tokens"].shape
    if len(shape) != 2:
        raise ValueError(f"SFT batch: tokens must be [B, L], got shape {shape}")
    for k in BATCH_KEYS[1:]:
        if batch[k].shape != shape:
            raise ValueError(f"SFT batch: {k} has shape {batch[k].shape}, tokens {shape}; they must match")
    if not cfg.prompt_len < shape[1]:
        raise ValueError(f"SFTConfig.prompt_len={cfg.prompt_len} leaves no target in sequences of length {shape[1]}")
    if shape[0] % cfg.num_microbatches:
        raise ValueError(f"SFT batch of {shape[0]} rows does not split into "
                         f"num_microbatches={cfg.num_microbatches}")


def init_state(params: PyTree, tx: optax.GradientTransformation) -> common.TrainState:
    return common.TrainState.create(params, tx)


def token_nll(model: Transformer, params, batch: Batch, prompt_len: int = 1, *,
              dropout_rng: jax.Array | None = None):
    """Per-token NLL and greedy-correctness of the target tokens.

    Returns `(nll [B, L − prompt_len], correct [B, L − prompt_len] bool, mask [B, L − prompt_len])`,
    target-aligned: column `j` is token `tokens[:, prompt_len + j]`. `dropout_rng`: LoRA
    adapter dropout on (training only, `common.dropout_key`).
    """
    tokens_BxL = batch["tokens"]
    hidden_BxTxD, _ = common.response_hidden(model, params, tokens_BxL, batch["input_mask"], prompt_len,
                                              dropout_rng=dropout_rng)
    targets_BxT = tokens_BxL[:, prompt_len:]
    out = common.head_logprobs(model.config, params, hidden_BxTxD, targets_BxT, with_argmax=True)
    correct_BxT = out.argmax == targets_BxT
    return -out.logp, correct_BxT, batch["loss_mask"][:, prompt_len:].astype(bool)


def loss_fn(params, batch: Batch, *, model: Transformer, cfg: SFTConfig,
            dropout_rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """`(loss, metrics)` of one batch: `ops.aggregate(nll, loss_mask, mode=cfg.agg)`.

    Metrics: `nll` (token-mean NLL, whatever `agg`), `token_accuracy` (greedy argmax equals
    the target, over loss tokens), and the sums `num_tokens`, `num_correct`. `dropout_rng`:
    LoRA adapter dropout on.
    """
    nll_BxT, correct_BxT, mask_BxT = token_nll(model, params, batch, cfg.prompt_len, dropout_rng=dropout_rng)
    loss = ops.aggregate(nll_BxT, mask_BxT, mode=cfg.agg, norm_len=cfg.norm_len)
    num_tokens = jnp.sum(mask_BxT, dtype=jnp.float32)
    num_correct = jnp.sum(correct_BxT & mask_BxT, dtype=jnp.float32)
    metrics = dict(nll=ops.masked_mean(jax.lax.stop_gradient(nll_BxT), mask_BxT),
                   token_accuracy=num_correct / jnp.maximum(num_tokens, 1.0),
                   num_tokens=num_tokens, num_correct=num_correct)
    return loss, metrics


def make_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: SFTConfig
                    ) -> Callable[[common.TrainState, Batch, jax.Array], tuple[common.TrainState, dict]]:
    """`step(state, batch, rng) -> (state, metrics)`, a pure function (not jitted).

    Jit it yourself, e.g. `jax.jit(step, donate_argnums=0)` (or with shardings); `rng`
    draws the LoRA adapter-dropout masks (`common.dropout_key`; unused without).

    Metrics: `loss`, `nll`, `token_accuracy` (exact over the whole batch), `num_tokens`,
    `grad_norm` (before clipping), `finite`. When `finite` is False the update is skipped
    (params and optimizer state are returned unchanged) so the caller can stop before
    saving.
    """
    n = cfg.num_microbatches

    def step(state: common.TrainState, batch: Batch, rng: jax.Array):
        check_batch(batch, cfg)
        mask_BxT = batch["loss_mask"][:, cfg.prompt_len:]
        total_tokens = jnp.sum(mask_BxT, dtype=jnp.float32)
        total_seqs = mask_BxT.shape[0]

        def micro_loss(params, mb, index):
            loss, metrics = loss_fn(params, mb, model=model, cfg=cfg,
                                    dropout_rng=common.dropout_key(model.config, rng, state.step, index))
            scale = common.accumulation_scale(mb["loss_mask"][:, cfg.prompt_len:], mode=cfg.agg,
                                              total_tokens=total_tokens, total_seqs=total_seqs)
            return loss * scale, metrics

        loss, metrics, grads = common.accumulate_gradients(
            micro_loss, state.params, {k: batch[k] for k in BATCH_KEYS}, num_microbatches=n)
        # Micro-batch metrics are averaged; the sums times n are exact full-batch sums.
        num_tokens, num_correct = metrics["num_tokens"] * n, metrics["num_correct"] * n
        new_state, finite = common.apply_if_finite(state, grads, tx, loss)
        out = dict(loss=loss, nll=metrics["nll"], token_accuracy=num_correct / jnp.maximum(num_tokens, 1.0),
                   num_tokens=num_tokens, grad_norm=optax.tree.norm(grads), finite=finite)
        return new_state, out

    return step


def jit_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: SFTConfig):
    """`jax.jit(make_train_step(...), donate_argnums=0)`: the state's buffers are reused."""
    return jax.jit(make_train_step(model, tx, cfg), donate_argnums=0)


def make_eval_step(model: Transformer, cfg: SFTConfig) -> Callable[[PyTree, Batch], dict]:
    """`eval_step(params, batch) -> metrics` (pure; jit it): `loss` (with `cfg.agg`), `nll`
    (token-mean), `token_accuracy`, `num_tokens`, `num_correct`.

    Combine batches by the sums: accuracy = Σ num_correct / Σ num_tokens. Rows to ignore
    (e.g. `data.eval_batches` tail padding) should have their `loss_mask` zeroed.
    """
    def eval_step(params, batch: Batch) -> dict:
        check_batch(batch, cfg)
        loss, metrics = loss_fn(params, batch, model=model, cfg=cfg)
        return dict(loss=loss, **metrics)

    return eval_step
