"""A pretrained reward model from a Hugging Face folder (`reward.model_path`), for GRPO and PPO.

The folder is a `*ForSequenceClassification` checkpoint with one label (a scalar "score"
head); its score of prompt ⧺ response at the last valid token joins the run's reward at
`reward.model_weight` (`phases.with_reward_model`), frozen (no optimizer state) and
compiled into the step: the parameters sit in the train state (`reward_params`, sharded by
the run's rules like the reference's), an argument of the compiled scoring program.

It reads the policy's token ids, so it must share the policy's vocabulary: with tokenizer
files in the folder, they must encode like the task's tokenizer (same size and the same
token-to-id map), else the run stops naming `reward.model_path` and the first difference;
without them only `vocab_size` is compared, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("jaxrlhf")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_folder(path: str) -> dict:
    """The folder's `config.json`, checked to be a scalar sequence classifier (a reward
    model), before any work; a ValueError naming `reward.model_path` otherwise."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"reward.model_path={path!r}: no config.json there; give a Hugging Face "
                         "*ForSequenceClassification folder (a reward model saved with save_pretrained)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"reward.model_path={path!r}: {cfg_file} is not valid JSON ({e})") from None
    archs = raw.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"reward.model_path={path!r}: architectures={archs} is not a reward model; expected a "
                         "*ForSequenceClassification folder (a causal LM goes in model.path)")
    return raw


def _as_hf(tokenizer):
    """A Hugging Face tokenizer for `tokenizer` (the built-in CharTokenizer converts)."""
    return tokenizer.to_hf() if hasattr(tokenizer, "to_hf") else tokenizer


def check_tokenizer(path: str, tokenizer, policy_vocab: int, raw: dict) -> None:
    """The folder's tokenizer encodes like the task's `tokenizer` (the same token-to-id
    map), or with no tokenizer files its `vocab_size` (from `raw`, its config.json) equals
    the policy's `policy_vocab` (logged as a warning: the check is weaker)."""
    from jaxrlhf.models.hf_checkpoint import load_tokenizer

    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        if raw.get("vocab_size") != policy_vocab:
            raise ValueError(f"reward.model_path={path!r}: vocab_size {raw.get('vocab_size')} != the policy's "
                             f"{policy_vocab}; the reward model must read the policy's token ids")
        log.warning("reward.model_path=%s has no tokenizer files: only its vocab_size (%d) was compared with the "
                    "policy's; save the policy's tokenizer in the folder to check that they encode alike",
                    path, policy_vocab)
        return
    theirs, ours = load_tokenizer(path).get_vocab(), _as_hf(tokenizer).get_vocab()
    if theirs == ours:
        return
    if len(theirs) != len(ours):
        detail = f"{len(theirs)} tokens against the task tokenizer's {len(ours)}"
    else:
        tok = next(t for t in sorted(ours) if theirs.get(t) != ours[t])
        detail = f"token {tok!r} is id {theirs.get(tok)} there and {ours[tok]} in the task tokenizer"
    raise ValueError(f"reward.model_path={path!r}: its tokenizer differs from the policy's ({detail}); the reward "
                     "model must read the policy's token ids")


def load(cfg, model_cfg, *, tokenizer, policy_vocab: int, placement):
    """`(model, params)` of the reward model at `cfg.model_path` (a config's `reward`
    section; None when it is empty), checked (`check_folder`, `check_tokenizer`) and read
    straight into the shardings of `placement`'s rules, in the policy's dtypes
    (`model_cfg`, the config's `model` section)."""
    from jaxrlhf.parallel.loading import load_pretrained_sharded

    path = cfg.get("model_path", "") if cfg is not None else ""
    if not path:
        return None
    path = os.fspath(path)
    raw = check_folder(path)
    check_tokenizer(path, tokenizer, policy_vocab, raw)
    model, params = load_pretrained_sharded(path, placement.mesh, placement.rules, on_indivisible="replicate",
                                            head="score", dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype)
    log.info("reward model from %s (weight %g), frozen", path, cfg.model_weight)
    return model, params


__all__ = ["check_folder", "check_tokenizer", "load"]
