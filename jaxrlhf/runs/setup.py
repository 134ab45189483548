"""The `model` section -> the model a run trains: fresh or from a checkpoint, with LoRA
adapters where its phases train them. (Every other section is built from its dataclass by
`options.build`.)"""

from __future__ import annotations

import logging

import jax

from jaxrlhf.models import ModelConfig, Transformer, count_params, load_pretrained, lora, quant, random_init
from jaxrlhf.models.config import RUNTIME_FIELDS
from jaxrlhf.parallel.loading import load_pretrained_sharded

log = logging.getLogger("jaxrlhf")


def build_model(cfg, *, vocab_size: int | None = None, head: str = "lm", seed: int = 0,
                pad_id: int = 0, bos_id: int | None = None, eos_id: int | None = None,
                placement=None) -> tuple[Transformer, dict]:
    """`config.model` -> `(model, params)`: a local HF checkpoint (`path`) or a fresh model.

    A fresh model takes its sizes from the section and `vocab_size` from the task's
    tokenizer; a checkpoint takes everything from its `config.json`. With a `placement`
    (`sharding.Placement`) the params come back in its shardings: a checkpoint is read
    tensor slice by tensor slice straight into them (each process reads only its own
    devices' shards); a fresh model is drawn on every process alike, then placed.
    """
    if cfg.path:
        kwargs = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, head=None if head == "lm" else head,
                      seed=seed, **_options(cfg))
        if placement is not None:
            model, params = load_pretrained_sharded(cfg.path, placement.mesh, placement.rules,
                                                    on_indivisible="replicate", **kwargs)
        else:
            model, params = load_pretrained(cfg.path, **kwargs)
        if vocab_size is not None and model.config.vocab_size < vocab_size:
            raise ValueError(f"model.path={cfg.path}: vocab_size {model.config.vocab_size} is smaller than the "
                             f"tokenizer's {vocab_size}")
        return model, params
    if vocab_size is None:
        raise ValueError("model.path is empty and the task gives no vocab_size for a fresh model")
    mc = ModelConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                     tie_word_embeddings=cfg.tie_word_embeddings, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, **_options(cfg))
    model, params = random_init(mc, head=head, seed=seed)
    log.info("fresh %s model with %.2fM parameters", head, count_params(params) / 1e6)
    if placement is not None:
        params = placement.place_params(model, params)
    return model, params


def lora_model(cfg, model: Transformer) -> Transformer:
    """`model` with the adapters of `cfg.lora` (a `config.model` section) in its config, or
    as it is when the rank is 0. Errors name `model.lora.<field>`. The model runs params
    with adapters (`start_adapters`) and without them (the base) alike."""
    lcfg = lora.from_section(cfg.lora) if "lora" in cfg else None
    if lcfg is None:
        return model
    config = model.config.replace(lora=lcfg, quantize=quant.check_kind(cfg.lora.get("quantize", "none")))
    lora.check_targets(config)
    return Transformer(config, head=model.head)


def start_adapters(model: Transformer, params, *, fresh: bool, seed: int, placement=None):
    """Before a policy phase of a LoRA run: the adapters of the phase before folded into
    the base (`lora.merge`), then, if `fresh`, new ones added (`lora.add_adapters`, B = 0,
    drawn from `seed`), so the phase starts from — and its reference is — the policy it is
    given. With QLoRA (`model.config.quantize`) the base is quantised before the adapters
    are added (de-quantised to merge, then quantised again, in a later adapter phase).
    Params of a model without `lora` are returned as they are."""
    if model.config.lora is None:
        return params
    if lora.has_adapters(params):
        params = lora.merge(model.config, quant.dequantize_base(model, params))
    if not fresh:
        return params if placement is None else placement.place(
            params, placement.param_shardings(quant.float_model(model)))
    if model.config.quantize != "none":
        nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20
        before, params = nbytes(params), quant.quantize_base(model, params)
        log.info("QLoRA: base params %.2f MiB -> %.2f MiB (layer projections as %s)", before, nbytes(params),
                 model.config.quantize)
    params = lora.add_adapters(model, params, jax.random.key(seed))
    log.info("LoRA rank %d on %s: %.3fM trained parameters of %.2fM", model.config.lora.rank,
             ",".join(model.config.lora.targets), count_params(lora.adapters(params)) / 1e6,
             count_params(params) / 1e6)
    return params if placement is None else placement.place_params(model, params)


def _options(cfg) -> dict:
    """The section's model options (`RUNTIME_FIELDS`: remat, attention, ...) it sets."""
    return {f: cfg[f] for f in RUNTIME_FIELDS if f in cfg}
