"""On-policy distillation (OPD): the student samples, a frozen teacher scores every sampled
token, and the per-token advantage is the teacher's log-prob less the student's
(docs/concepts.md#on-policy-distillation; Agarwal et al. 2024, arXiv:2306.13649):

    A_t = sg(teacher_logp_t − old_logp_t) + λ·A_task_t        (`ops.distillation_advantages`)

on the student's own tokens: no discount, no group normalisation; `λ = task_weight` mixes
in the GRPO-family advantage of the task's reward (`GRPOConfig.advantage`; 0: distillation
alone). The loss is GRPO's clipped policy loss (`grpo.loss_fn`) on these advantages, so
minimising it lowers the per-token reverse KL(π‖teacher) on the student's samples
(`distill/reverse_kl`, its k1 estimate `mean_t(old_logp_t − teacher_logp_t)`).

The algorithm is GRPO's by composition: `split` is `grpo.split` with its scoring program
wrapped (`score`: `grpo.score`, then the teacher's log-probs and the advantages above), the
state `GRPOState` plus the teacher's parameters (`OPDState.teacher_params`, frozen: no
optimizer state, an argument of the compiled scoring program). The teacher is any causal
LM that reads the student's token ids (another size, its own shardings: `load_teacher`);
its log-probs go through the fused LM head (`ops.linear_logprobs`, `logprobs_head="chunked"`),
so no `[N, T, V]` logits are ever held. A teacher whose vocabulary is smaller than the
student's (padding rows) scores a sampled id beyond it at `OUTSIDE_LOGP`. A student with
LoRA adapters may be taught by its own base (`teacher_params=None`: `teacher_params_of`,
the base arrays without the adapters, no copy; the teacher model is the student's).

    state = opd.init_state(params, tx, teacher_params)
    parts = opd.split(model, teacher, tx, grpo_cfg, opd.OPDConfig(), task_reward)
    # `parts` is a `timing.Split`: jit `parts.fused`, or run rollout / score / train apart
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from jaxrlhf import ops
from jaxrlhf import rewards as rewards_lib
from jaxrlhf.algorithms import common, grpo, timing
from jaxrlhf.algorithms.experience import score_responses
from jaxrlhf.algorithms.grpo_config import GRPOConfig
from jaxrlhf.models import lora
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.options import check, option

PyTree = Any
log = logging.getLogger("jaxrlhf")

# The teacher's log-prob of a sampled id beyond its vocabulary (a student's padding row):
# probability e^-30 ≈ 1e-13, a large but finite negative advantage.
OUTSIDE_LOGP = -30.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class OPDConfig:
    """OPD's own options, beside GRPO's (`GRPOConfig`: sampling, clipping, aggregation, μ,
    minibatches, the KL to a reference) in one config section."""

    task_weight: float = option(0.0, "λ: the advantage is sg(teacher_logp − old_logp) + λ·A_task, A_task the "
                                "task reward's advantage by the section's `advantage` estimator; 0: distillation "
                                "alone (the task's reward is still measured: reward/mean)", min=0)

    def __post_init__(self):
        check(self)


@flax.struct.dataclass
class OPDState(grpo.GRPOState):
    """GRPO's state (`policy`, `ref_params`, ...) and the frozen teacher's parameters."""

    teacher_params: PyTree = None


def teacher_params_of(state: OPDState) -> PyTree:
    """The teacher's params: `state.teacher_params`, or when there are none and the student
    has LoRA adapters, the student's base without them (`lora.without_adapters`: the same
    arrays, no copy; `opd.teacher_path="base"`)."""
    if state.teacher_params is None:
        if not lora.has_adapters(state.policy.params):
            raise ValueError("OPD: no teacher params, and the student has no LoRA adapters whose base could teach")
        return lora.without_adapters(state.policy.params)
    return state.teacher_params


def init_state(params, tx: optax.GradientTransformation, teacher_params, *, ref_params=None,
               cfg: GRPOConfig | None = None) -> OPDState:
    """`grpo.init_state(params, tx, ref_params, cfg=cfg)` with the teacher's parameters."""
    base = grpo.init_state(params, tx, ref_params, cfg=cfg)
    return OPDState(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                    teacher_params=teacher_params)


def fused_head(teacher: Transformer) -> Transformer:
    """`teacher` with the fused LM head (`logprobs_head="chunked"`: `ops.linear_logprobs`,
    never the `[N, T, V]` logits)."""
    if teacher.config.logprobs_head == "chunked":
        return teacher
    return Transformer(dataclasses.replace(teacher.config, logprobs_head="chunked"), head=teacher.head)


def teacher_logprobs(teacher: Transformer, teacher_params, sequences, attention_mask, prompt_len: int, *,
                     group_size: int = 1) -> jax.Array:
    """`[N, T]` log-probs of the response tokens of `sequences` under the teacher (at
    temperature 1, its own distribution; no gradient), through the fused head
    (`fused_head`). An id at or beyond the teacher's vocabulary is read as 0 and scored
    `OUTSIDE_LOGP`."""
    teacher = fused_head(teacher)
    outside = sequences >= teacher.config.vocab_size
    logp, _, _ = common.response_logprobs(teacher, jax.lax.stop_gradient(teacher_params),
                                          jnp.where(outside, 0, sequences), attention_mask, prompt_len,
                                          temperature=1.0, group_size=group_size)
    return jnp.where(outside[:, prompt_len:], OUTSIDE_LOGP, logp)


def score(state: OPDState, out, extras, host_scores: dict, rng, *, model: Transformer, teacher: Transformer,
          cfg: GRPOConfig, opd_cfg: OPDConfig, reward: rewards_lib.Reward) -> tuple[grpo.Batch, dict]:
    """`grpo.score` (the task's reward and its advantages, old/ref log-probs), then the
    teacher's log-probs of the same responses and the batch's advantages replaced by
    `ops.distillation_advantages(teacher_logp, old_logp, mask) + task_weight·A_task`.

    Metrics beside GRPO's: `distill/reverse_kl` (`mean_t(old_logp − teacher_logp)` over the
    valid tokens: the k1 estimate of the per-token reverse KL), `distill/teacher_logp`,
    `distill/student_logp`; `advantage/mean` and `/std` are the new advantages'. With
    `task_weight` 0 every response is distilled, also one a host reward left unscored."""
    batch, metrics = grpo.score(state, out, extras, host_scores, rng, model=model, cfg=cfg, reward=reward)
    mask = batch.response_mask if opd_cfg.task_weight else out.response_mask
    n, p = mask.shape[0], batch.sequences.shape[1] - mask.shape[1]
    group = cfg.prompt_group(n)
    old_logp = batch.old_logp
    if old_logp is None:  # μ = 1, one minibatch: grpo.score leaves it to the loss's own forward
        old_logp = score_responses(model, state.policy.params, batch.sequences, batch.attention_mask, p,
                                   temperature=cfg.sampling.temperature, group_size=group)
    t_logp = teacher_logprobs(teacher, teacher_params_of(state), batch.sequences, batch.attention_mask, p,
                              group_size=group)
    adv = ops.distillation_advantages(t_logp, old_logp, mask)
    if opd_cfg.task_weight:
        metrics["advantage/task_mean"] = metrics["advantage/mean"]
        adv = adv + opd_cfg.task_weight * batch.advantages
    metrics.pop("advantage/zero_group_fraction", None)  # a group statistic of the task's advantages
    metrics.update({"distill/reverse_kl": ops.masked_mean(old_logp - t_logp, mask),
                    "distill/teacher_logp": ops.masked_mean(t_logp, mask),
                    "distill/student_logp": ops.masked_mean(old_logp, mask),
                    "advantage/mean": ops.masked_mean(adv, mask),
                    "advantage/std": jnp.sqrt(ops.masked_var(adv, mask))})
    return batch._replace(advantages=adv, response_mask=mask), metrics


def split(model: Transformer, teacher: Transformer, tx: optax.GradientTransformation, cfg: GRPOConfig,
          opd_cfg: OPDConfig, reward, *, schedule: Callable | None = None) -> timing.Split:
    """The OPD iteration as `timing.Split(rollout, score, train)`: `grpo.split`'s rollout
    and update, its scoring wrapped by `score` (the teacher through the fused head)."""
    if cfg.dynamic_sampling or cfg.guide_coef:
        raise ValueError("OPD distils every sampled response: dynamic_sampling and guide_coef are GRPO's, set them "
                         "off")
    reward = rewards_lib.as_reward(reward)
    parts = grpo.split(model, tx, cfg, reward, schedule=schedule)
    return parts._replace(score=functools.partial(score, model=model, teacher=fused_head(teacher), cfg=cfg,
                                                  opd_cfg=opd_cfg, reward=reward))


# --------------------------------------------------------------------------- the teacher's folder


def _tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return repr(name)


def check_teacher(path: str, tokenizer, student_vocab: int, *, field: str = "opd.teacher_path") -> dict:
    """The teacher's folder checked before any work: a causal LM's `config.json` there,
    its vocabulary holding every id of the student's tokenizer (`student_vocab` tokens),
    and with tokenizer files there the same token-to-id map as `tokenizer` (the student's,
    the task's); without them only the sizes are compared, with a warning. Returns its
    `config.json`; a ValueError naming `field`, the teacher and the student otherwise."""
    if not path:
        raise ValueError(f"{field} is empty: OPD needs a teacher, a local Hugging Face causal-LM folder (e.g. an "
                         "earlier run's workdir/export)")
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{field}={path!r}: no Hugging Face checkpoint folder there (no config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}={path!r}: {cfg_file} is not valid JSON ({e})") from None
    archs = raw.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{field}={path!r}: architectures={archs} is a reward model; the teacher is a causal LM")
    student = _tokenizer_name(tokenizer)
    teacher_vocab = raw.get("vocab_size")
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        if teacher_vocab is None or teacher_vocab < student_vocab:
            raise ValueError(f"{field}={path!r}: the teacher's vocab_size {teacher_vocab} does not hold the "
                             f"student's tokenizer {student} ({student_vocab} tokens); teacher and student must "
                             "share the tokenizer")
        log.warning("%s=%s has no tokenizer files: only its vocab_size (%d) was compared with the student's "
                    "tokenizer (%d tokens); save the student's tokenizer in the folder to check they encode alike",
                    field, path, teacher_vocab, student_vocab)
        return raw
    from jaxrlhf.models.hf_checkpoint import load_tokenizer

    ours = (tokenizer.to_hf() if hasattr(tokenizer, "to_hf") else tokenizer).get_vocab()
    theirs = load_tokenizer(path).get_vocab()
    if theirs != ours:
        if len(theirs) != len(ours):
            detail = f"{len(theirs)} tokens there against {len(ours)}"
        else:
            tok = next(t for t in sorted(ours) if theirs.get(t) != ours[t])
            detail = f"token {tok!r} is id {theirs.get(tok)} there and {ours[tok]} in the student's"
        raise ValueError(f"{field}={path!r}: the teacher's tokenizer differs from the student's tokenizer {student} "
                         f"({detail}); teacher and student must share the tokenizer (vocabulary sizes may differ "
                         "by padding)")
    if teacher_vocab is not None and teacher_vocab < len(ours):
        raise ValueError(f"{field}={path!r}: the teacher's vocab_size {teacher_vocab} is smaller than the student's "
                         f"tokenizer {student} ({len(ours)} tokens)")
    return raw


__all__ = ["OPDConfig", "OPDState", "OUTSIDE_LOGP", "check_teacher", "fused_head", "init_state",
           "score", "split", "teacher_logprobs"]
