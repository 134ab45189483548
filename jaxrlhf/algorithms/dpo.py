"""Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290) on offline pairs.

A batch holds B preference pairs (`data.preference_batch`, `data.preference_arrays`):

    prompt_ids, prompt_mask        [B, P]  left-padded prompts
    chosen_ids, chosen_mask        [B, T]  right-padded preferred responses (EOS included)
    rejected_ids, rejected_mask    [B, T]  right-padded other responses
    ref_chosen_logp                [B]     Σ_t log π_ref(chosen_t | ·), precomputed once
    ref_rejected_logp              [B]     the same for the rejected responses

The reference never runs inside the train step: `precompute_reference_logprobs` adds the
two `ref_*_logp` columns to the whole dataset once. The policy scores chosen and rejected
in one forward pass over `2B` rows (prompt ⧺ chosen, then prompt ⧺ rejected), running
each prompt once for both (`common.shared_prompt_hidden`); sequence log-probs are sums
over response tokens (`ops.sequence_logprobs`) and the loss is `ops.dpo_loss` (sigmoid
with label smoothing, ipo, hinge; docs/concepts.md#preference-losses).

    data = precompute_reference_logprobs(model, ref_params, preference_arrays)
    state = init_state(params, tx)
    step = jax.jit(make_train_step(model, tx, DPOConfig(beta=0.1)), donate_argnums=0)
    state, metrics = step(state, {k: v[idx] for k, v in data.items()}, rng)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrlhf import ops
from jaxrlhf.algorithms import common
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.ops._losses import DPO_LOSS_TYPES
from jaxrlhf.options import check, option

PyTree = Any
Batch = Mapping[str, jax.Array]
PAIR_KEYS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
REF_KEYS = ("ref_chosen_logp", "ref_rejected_logp")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """DPO and its variants (each field's doc and bounds on the field)."""

    beta: float = option(0.1, "β, the strength of the implicit KL constraint to the reference", above=0)
    loss_type: str = option("sigmoid", "'sigmoid' (DPO), 'ipo' or 'hinge' (SLiC); see `ops.dpo_loss`",
                            choices=DPO_LOSS_TYPES)
    label_smoothing: float = option(0.0, "the assumed rate of flipped labels (cDPO); sigmoid only", min=0, below=0.5)
    nll_coef: float = option(0.0, "α, the weight of the chosen responses' per-token NLL added to the loss (RPO, "
                             "TRL's rpo_alpha): it keeps the chosen answers likely while the pairs are ranked", min=0)
    num_microbatches: int = option(1, "gradient accumulation steps per batch; must divide the batch (the loss is a "
                                   "mean over pairs, reproduced exactly)", min=1)

    def __post_init__(self):
        check(self)
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"DPOConfig: label_smoothing applies to loss_type='sigmoid' only, not {self.loss_type!r}")


def check_pairs(batch: Batch, *, with_reference: bool = True, num_microbatches: int = 1) -> None:
    """Raises ValueError for a missing key, mismatched shapes or a batch that does not split."""
    keys = PAIR_KEYS + (REF_KEYS if with_reference else ())
    missing = [k for k in keys if k not in batch]
    if missing:
        hint = " (run precompute_reference_logprobs first)" if set(missing) & set(REF_KEYS) else ""
        raise ValueError(f"DPO batch is missing {missing}{hint}; expected keys {keys}")
    pshape = batch["prompt_ids"].shape
    if len(pshape) != 2:
        raise ValueError(f"DPO batch: prompt_ids must be [B, P], got shape {pshape}")
    b = pshape[0]
    if batch["prompt_mask"].shape != pshape:
        raise ValueError(f"DPO batch: prompt_mask has shape {batch['prompt_mask'].shape}, prompt_ids {pshape}")
    for name in ("chosen", "rejected"):
        ids, mask = batch[f"{name}_ids"].shape, batch[f"{name}_mask"].shape
        if len(ids) != 2 or ids[0] != b:
            raise ValueError(f"DPO batch: {name}_ids must be [B, T] with B = {b} (prompt_ids), got {ids}")
        if mask != ids:
            raise ValueError(f"DPO batch: {name}_mask has shape {mask}, {name}_ids {ids}")
    if with_reference:
        for k in REF_KEYS:
            if batch[k].shape != (b,):
                raise ValueError(f"DPO batch: {k} must be [B] = ({b},), got {batch[k].shape}")
    if b % num_microbatches:
        raise ValueError(f"DPO batch of {b} pairs does not split into num_microbatches={num_microbatches}")


def init_state(params: PyTree, tx: optax.GradientTransformation) -> common.TrainState:
    return common.TrainState.create(params, tx)


def _pad_to(x_BxT: jax.Array, length: int) -> jax.Array:
    return jnp.pad(x_BxT, ((0, 0), (0, length - x_BxT.shape[1])))


def pair_sequences(batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Chosen and rejected stacked into one batch of `2B` rows (chosen first).

    Returns `(sequences [2B, P + T], attention_mask [2B, P + T], response_mask [2B, T], P)`;
    the shorter of the two response arrays is right-padded to the longer's `T`.
    """
    t = max(batch["chosen_ids"].shape[1], batch["rejected_ids"].shape[1])
    response_ids = jnp.concatenate([_pad_to(batch["chosen_ids"], t), _pad_to(batch["rejected_ids"], t)])
    response_mask = jnp.concatenate([_pad_to(batch["chosen_mask"], t), _pad_to(batch["rejected_mask"], t)])
    prompt_ids = jnp.concatenate([batch["prompt_ids"]] * 2)
    prompt_mask = jnp.concatenate([batch["prompt_mask"]] * 2)
    sequences = jnp.concatenate([prompt_ids, response_ids], axis=1)
    attention_mask = jnp.concatenate([prompt_mask.astype(bool), response_mask.astype(bool)], axis=1)
    return sequences, attention_mask, response_mask, prompt_ids.shape[1]


def pair_logprobs(model: Transformer, params, batch: Batch, *, share_prompt: bool = True,
                  dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Sequence log-probs `(chosen [B], rejected [B])` in one forward pass of `2B` rows.

    With `share_prompt` (default) each prompt runs once and both of its responses attend
    to its keys and values (`common.shared_prompt_hidden`): the same numbers up to float
    rounding, `2(P + T) → P + 2T` tokens per pair through the layers. `dropout_rng`: LoRA
    adapter dropout on (training only, `common.dropout_key`).
    """
    sequences, attention_mask, response_mask, p = pair_sequences(batch)
    if share_prompt:
        hidden, _ = common.shared_prompt_hidden(
            model, params, batch["prompt_ids"], batch["prompt_mask"], sequences[:, p:], response_mask,
            expand=lambda x: jnp.concatenate([x, x]), dropout_rng=dropout_rng)
        logp_2BxT, _ = common.hidden_logprobs(model, params, hidden, sequences[:, p:])
    else:
        logp_2BxT, _, _ = common.response_logprobs(model, params, sequences, attention_mask, p,
                                                 dropout_rng=dropout_rng)
    seq_logp_2B = ops.sequence_logprobs(logp_2BxT, response_mask)
    b = batch["prompt_ids"].shape[0]
    return seq_logp_2B[:b], seq_logp_2B[b:]


# Compiled once per (model, shapes) and reused across calls.
_pair_logprobs_jit = jax.jit(pair_logprobs, static_argnums=0)


def precompute_reference_logprobs(
    model: Transformer,
    ref_params: PyTree,
    pairs: Mapping[str, np.ndarray],
    *,
    batch_size: int = 64,
    score_fn: Callable[[PyTree, dict], tuple[Any, Any]] | None = None,
) -> dict[str, np.ndarray]:
    """Adds `ref_chosen_logp`, `ref_rejected_logp` `[N]` (float32) to a whole set of pairs.

    Runs the frozen reference once over the dataset, `batch_size` pairs per forward pass
    (one compiled shape: the tail is padded with the last row and dropped). Returns a new
    dict; index it per step like the input (`{k: v[idx] for k, v in out.items()}`).

    `score_fn(ref_params, batch) -> (chosen [b], rejected [b])` replaces the jitted
    `pair_logprobs` (e.g. one that places the batch on a device mesh and reads the result
    back on every process).
    """
    check_pairs(pairs, with_reference=False)
    if score_fn is None:
        score_fn = functools.partial(_pair_logprobs_jit, model)
    n = pairs["prompt_ids"].shape[0]
    chosen, rejected = [], []
    for start in range(0, n, batch_size):
        idx = np.minimum(np.arange(start, start + batch_size), n - 1)
        c, r = score_fn(ref_params, {k: np.asarray(pairs[k])[idx] for k in PAIR_KEYS})
        keep = min(batch_size, n - start)
        chosen.append(np.asarray(c)[:keep])
        rejected.append(np.asarray(r)[:keep])
    out = dict(pairs)
    out["ref_chosen_logp"] = np.concatenate(chosen).astype(np.float32)
    out["ref_rejected_logp"] = np.concatenate(rejected).astype(np.float32)
    return out


def loss_fn(params, batch: Batch, *, model: Transformer, cfg: DPOConfig,
            dropout_rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """`ops.dpo_loss` of the policy's sequence log-probs against the precomputed reference,
    plus the RPO term when `cfg.nll_coef = α > 0`:

        L = dpo_loss + α · mean_i nll_i,   nll_i = −log π(chosen_i | prompt_i) / |chosen_i|

    (`|chosen_i|` its valid tokens, EOS included; a mean over pairs, so that micro-batch
    accumulation reproduces it exactly).

    Metrics (means over pairs): `reward_accuracy` (fraction with margin > 0), `margin`
    (`z = β((π_c − ref_c) − (π_r − ref_r))`), `chosen_reward`, `rejected_reward`,
    `chosen_logp`, `rejected_logp`, `chosen_nll` (`nll_i`, reported whatever α) and
    `dpo_loss` (the loss without the RPO term). `dropout_rng`: LoRA adapter dropout on.
    """
    chosen_logp, rejected_logp = pair_logprobs(model, params, batch, dropout_rng=dropout_rng)
    loss, metrics = ops.dpo_loss(chosen_logp, rejected_logp, batch["ref_chosen_logp"], batch["ref_rejected_logp"],
                                 beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)
    tokens_B = jnp.maximum(jnp.sum(batch["chosen_mask"], axis=1), 1).astype(jnp.float32)
    nll = jnp.mean(-chosen_logp / tokens_B)
    metrics = dict(metrics, chosen_logp=jnp.mean(jax.lax.stop_gradient(chosen_logp)),
                   rejected_logp=jnp.mean(jax.lax.stop_gradient(rejected_logp)),
                   chosen_nll=jax.lax.stop_gradient(nll), dpo_loss=jax.lax.stop_gradient(loss))
    if cfg.nll_coef:
        loss = loss + cfg.nll_coef * nll
    return loss, metrics


def make_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: DPOConfig
                    ) -> Callable[[common.TrainState, Batch, jax.Array], tuple[common.TrainState, dict]]:
    """`step(state, batch, rng) -> (state, metrics)`, a pure function (not jitted).

    Jit it yourself, e.g. `jax.jit(step, donate_argnums=0)` (or `jit_train_step`); `rng`
    draws the LoRA adapter-dropout masks (`common.dropout_key`; unused without). The batch must carry the reference
    log-probs (`precompute_reference_logprobs`).

    Metrics: those of `loss_fn` (averaged over micro-batches), `loss`, `grad_norm` (before
    clipping) and `finite`; when `finite` is False the update is skipped.
    """
    n = cfg.num_microbatches
    return common.make_row_mean_step(functools.partial(loss_fn, model=model, cfg=cfg), tx,
                                     keys=PAIR_KEYS + REF_KEYS, num_microbatches=n, model_config=model.config,
                                     check=lambda batch: check_pairs(batch, num_microbatches=n))


def jit_train_step(model: Transformer, tx: optax.GradientTransformation, cfg: DPOConfig):
    """`jax.jit(make_train_step(...), donate_argnums=0)`: the state's buffers are reused."""
    return jax.jit(make_train_step(model, tx, cfg), donate_argnums=0)


def make_eval_step(model: Transformer, cfg: DPOConfig) -> Callable[[PyTree, Batch], dict]:
    """`eval_step(params, batch) -> metrics` (pure; jit it) on held-out pairs.

    Metrics are means over pairs weighted by `batch["weight"]` `[B]` (optional, default
    ones; zero it for `data.eval_batches` tail padding), plus `weight` = Σ weights, so that
    batches combine as Σ w·m / Σ w: `loss`, `reward_accuracy` (the preference accuracy:
    fraction of pairs whose implicit reward margin is > 0), `margin`, `chosen_reward`,
    `rejected_reward`.
    """
    def per_pair(c, r, rc, rr):
        return ops.dpo_loss(c[None], r[None], rc[None], rr[None], beta=cfg.beta, loss_type=cfg.loss_type,
                            label_smoothing=cfg.label_smoothing)

    def eval_step(params, batch: Batch) -> dict:
        check_pairs(batch)
        chosen_logp, rejected_logp = pair_logprobs(model, params, batch)
        loss_B, metrics_B = jax.vmap(per_pair)(chosen_logp, rejected_logp, batch["ref_chosen_logp"],
                                               batch["ref_rejected_logp"])
        weight_B = jnp.asarray(batch.get("weight", jnp.ones_like(loss_B)), jnp.float32)
        total = jnp.sum(weight_B)

        def mean(x):
            return jnp.sum(weight_B * x) / jnp.maximum(total, 1e-12)

        return dict(loss=mean(loss_B), weight=total, **{k: mean(v) for k, v in metrics_B.items()})

    return eval_step
