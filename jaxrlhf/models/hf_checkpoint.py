"""Hugging Face checkpoint I/O: `config.json` + safetensors folders in, and out.

`load_pretrained` reads a local folder written by transformers' `save_pretrained`
(`*ForCausalLM` or `*ForSequenceClassification` with one label) into a `Transformer` and a
params pytree, one tensor at a time; `save_pretrained` writes the same layout back, so the
folder loads in transformers unchanged. Only safetensors are read: pickle files
(`pytorch_model.bin`, `*.pt`) can execute code when loaded and are refused, and so is any
config that asks for repository code (`auto_map`).

The HF tensor ↔ parameter mapping is in `jaxrlhf.models.hf_layout`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import uuid
from contextlib import ExitStack
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models.config import (RUNTIME_FIELDS, ModelConfig, UnsupportedConfigError, check_model_type,
                                   from_hf_config, to_hf_dict)
from jaxrlhf.models.hf_layout import (  # noqa: F401  (_trunk_tensors, _head_tensors: used by tests)
    _get, _head_tensors, _LayerOf, _param_of, _params_of, _set, _Tensor, _trunk_tensors)
from jaxrlhf.models.hf_layout import stack_layers
from jaxrlhf.models.transformer import HEADS, Transformer

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")
# Buffers that some transformers versions wrote into checkpoints; never parameters.
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq", "rotary_emb.inv_freq")
_ARCH_HEADS = (("ForCausalLM", "lm"), ("ForSequenceClassification", "score"))
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


class CheckpointError(ValueError):
    """A checkpoint is missing, unsafe, corrupt, partial, or does not match what reads it:
    a Hugging Face folder and its config (here), or a run's training checkpoint and the
    current state (`runs.checkpointing`)."""


# ----------------------------------------------------------------------------- reading


def _read_json(file: str) -> Any:
    """A JSON file of a checkpoint folder; one that is not valid JSON (truncated, corrupt) is
    a `CheckpointError` naming the file, not a bare `JSONDecodeError`."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt: it is not valid JSON ({e})") from e


def load_generation_config(path: str | os.PathLike) -> dict:
    """The folder's `generation_config.json` ({} when it has none); one that is not valid
    JSON is a `CheckpointError` naming the file."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    return _read_json(file) if os.path.isfile(file) else {}


def _safe_open(file: str):
    """`safetensors.safe_open(file)` (numpy); a file safetensors cannot read (truncated,
    corrupt header) is a `CheckpointError` naming the file (the shard, when sharded)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e


def _read_config_json(path: str) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a local directory; load_pretrained reads local "
                              "folders only (download with `huggingface-cli download` first)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"no config.json in {path}")
    raw = _read_json(cfg_file)
    if raw.get("auto_map"):
        raise CheckpointError(
            f"{cfg_file}: `auto_map` {sorted(raw['auto_map'])} asks for the repository's own "
            "Python code (trust_remote_code); jaxrlhf never executes checkpoint code. Only "
            "the standard transformers families are supported (docs/models.md)")
    try:
        check_model_type(raw.get("model_type"))
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(str(e).replace("config.json", cfg_file, 1)) from None
    return raw


def _head_from_architectures(raw: Mapping[str, Any], cfg_file: str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        for suffix, head in _ARCH_HEADS:
            if arch.endswith(suffix):
                n = raw["num_labels"] if "num_labels" in raw else len(raw.get("id2label") or {}) or 2
                if head == "score" and n != 1:
                    raise CheckpointError(
                        f"{cfg_file}: {arch} has num_labels={n}; only a scalar head (num_labels=1, "
                        "a reward or value model) is supported")
                return head
    if not archs:
        raise CheckpointError(f"{cfg_file}: no `architectures`; pass head='lm' (causal LM weights) "
                              "or head='score' (sequence-classification weights)")
    raise CheckpointError(f"{cfg_file}: architectures={archs!r}; expected a *ForCausalLM or "
                          "*ForSequenceClassification model")


def _weight_files(path: str) -> tuple[dict[str, str], str]:
    """HF tensor name → safetensors file, from the index or the single file."""
    index = os.path.join(path, SAFE_INDEX)
    single = os.path.join(path, SAFE_WEIGHTS)
    if os.path.isfile(index):
        weight_map = _read_json(index)["weight_map"]
        for fname in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, fname)):
                raise CheckpointError(f"{index}: shard {fname} is listed but missing from {path}")
        return dict(weight_map), SAFE_INDEX
    if os.path.isfile(single):
        with _safe_open(single) as f:
            return {k: SAFE_WEIGHTS for k in f.keys()}, SAFE_WEIGHTS
    pickles = sorted({os.path.basename(p) for pat in _PICKLE_PATTERNS for p in glob.glob(os.path.join(path, pat))})
    if pickles:
        raise CheckpointError(
            f"{path} holds only pickle weights ({', '.join(pickles)}), which can execute code when "
            "loaded; jaxrlhf reads safetensors only. Convert once in a trusted environment: "
            "`transformers.AutoModelForCausalLM.from_pretrained(path).save_pretrained(out_dir, "
            "safe_serialization=True)`")
    raise CheckpointError(f"no {SAFE_WEIGHTS} or {SAFE_INDEX} in {path}")


def _ignorable(name: str) -> bool:
    return name.endswith(_IGNORABLE_SUFFIXES)


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    head: str | None = None,
    seed: int = 0,
    shardings: Any = None,
    **options,
) -> tuple[Transformer, dict]:
    """Load a local Hugging Face checkpoint folder into `(Transformer, params)`.

    Args:
      path: a folder with `config.json` and `model.safetensors` (or the sharded
        `model.safetensors.index.json` + `model-0000i-of-0000n.safetensors`).
      dtype: compute dtype ("float32", "bfloat16", "float16"); defaults to `param_dtype`.
      param_dtype: storage dtype of the params; every tensor is cast to it. Default float32.
      head: "lm", "score" or "lm_value"; by default from `architectures` (`*ForCausalLM` →
        "lm", `*ForSequenceClassification` with `num_labels == 1` → "score"). A head the
        checkpoint lacks (e.g. "score" or "lm_value" on a causal LM) is initialised from
        N(0, 0.02) with `seed`, and a checkpoint head the model does not use is dropped;
        both are logged as warnings.
      options: the `ModelConfig` fields a checkpoint does not store (`RUNTIME_FIELDS`:
        `remat`, `attention`, `cache_dtype`, `scan_layers`); anything else is refused. With
        `scan_layers=True` the layers come stacked (`layers/...` `[n, ...]`).
      seed: seeds the freshly initialised head parameters, if any.
      shardings: optional pytree like the params of `jax.sharding.Sharding`s, or a function
        `Transformer -> pytree` (e.g. `lambda m: parallel.param_shardings(m, mesh, rules)`).
        Each tensor is then built with `jax.make_array_from_callback`: every device reads
        only its own slice of the safetensors file, so neither a host nor a device ever
        holds the full model (in a multi-process run each process reads its devices' shards).

    Returns:
      `(model, params)`; `model.apply({"params": params}, ids, mask)`.

    Raises:
      CheckpointError: missing `config.json`, pickle-only weights, `auto_map` (remote code),
        a missing, unexpected or wrongly shaped tensor, a truncated or corrupt `config.json`,
        index or safetensors file (shard); the message names file and tensor.
      UnsupportedConfigError: a `model_type`, rope type or other field this decoder lacks.
    """
    path = os.fspath(path)
    raw = _read_config_json(path)
    cfg_file = os.path.join(path, "config.json")
    native = _head_from_architectures(raw, cfg_file) if head is None or raw.get("architectures") else head
    head = head or native
    if head not in HEADS:
        raise ValueError(f"head={head!r}; expected one of {HEADS}")
    import transformers  # imported lazily: heavy, and only the config parser is used

    hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    param_dtype = param_dtype or "float32"
    unknown = sorted(set(options) - set(RUNTIME_FIELDS))
    if unknown:
        raise TypeError(f"load_pretrained: unknown options {unknown}; the model options are {list(RUNTIME_FIELDS)}")
    try:
        config = from_hf_config(hf_config, dtype=dtype or param_dtype, param_dtype=param_dtype, **options)
    except UnsupportedConfigError as e:
        msg = str(e)
        raise UnsupportedConfigError(msg.replace("config.json", cfg_file, 1) if "config.json" in msg
                                     else f"{cfg_file}: {msg}") from None
    weight_map, weight_source = _weight_files(path)
    wanted = _trunk_tensors(config) + _head_tensors(config, head)
    in_file = {t.hf_name for t in _trunk_tensors(config) + _head_tensors(config, native)}
    fresh = [t for t in wanted if t.hf_name not in in_file]
    dropped = sorted({t.hf_name for t in _head_tensors(config, native)} - {t.hf_name for t in wanted})
    to_read = [t for t in wanted if t.hf_name in in_file]

    missing = [t.hf_name for t in to_read if t.hf_name not in weight_map]
    if missing:
        raise CheckpointError(f"{os.path.join(path, weight_source)}: missing tensors {missing[:10]}"
                              + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
    known = {t.hf_name for t in to_read} | set(dropped)
    tied_lm_head = config.tie_word_embeddings and "lm_head.weight" in weight_map
    unexpected = sorted(k for k in weight_map if k not in known and not _ignorable(k)
                        and not (tied_lm_head and k == "lm_head.weight"))
    if unexpected:
        raise CheckpointError(
            f"{os.path.join(path, weight_source)}: unexpected tensors {unexpected[:10]}"
            + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else "")
            + f" for a {config.model_type} model with head {head!r} (does config.json match the weights?)")
    if dropped:
        logger.warning("%s: head %r requested; dropping the checkpoint's %s", path, head, dropped)
    if fresh:
        logger.warning("%s: the checkpoint has no %s; initialising %s from N(0, 0.02) with seed %d",
                       path, [".".join(t.path) for t in fresh], "it" if len(fresh) == 1 else "them", seed)

    target = jnp.dtype(param_dtype)
    if callable(shardings):
        shardings = shardings(Transformer(config, head))
    place = (lambda x, t: jax.device_put(x, _get(shardings, t.path))) if shardings is not None else (
        lambda x, t: jax.device_put(x))
    params: dict = {}
    with ExitStack() as stack:
        handles = {fname: stack.enter_context(_safe_open(os.path.join(path, fname)))
                   for fname in sorted({weight_map[t.hf_name] for t in to_read})}
        for t in to_read:
            fname = weight_map[t.hf_name]
            if t.hf_name not in handles[fname].keys():
                raise CheckpointError(f"{fname}: tensor {t.hf_name!r} is listed in {SAFE_INDEX} but "
                                      "not stored in the file")
            shape = tuple(handles[fname].get_slice(t.hf_name).get_shape())
            if shape != t.hf_shape:
                raise CheckpointError(f"{fname}: tensor {t.hf_name!r} has shape {shape}, expected "
                                      f"{t.hf_shape}")
        files = {t.hf_name: handles[weight_map[t.hf_name]] for t in to_read}
        for param in _params_of(config, to_read):
            if shardings is not None:
                read = lambda index, param=param: param.read(files, index).astype(target)
                _set(params, param.path, jax.make_array_from_callback(param.shape, _get(shardings, param.path), read))
            else:
                _set(params, param.path, jax.device_put(param.read(files).astype(target)))
    if tied_lm_head:
        _check_tied(path, weight_map)
    rng = jax.random.key(seed)
    for i, t in enumerate(fresh):
        w = 0.02 * jax.random.normal(jax.random.fold_in(rng, i), t.shape, jnp.float32)
        _set(params, t.path, place(w.astype(target), t))
    return Transformer(config, head), params


def _check_tied(path: str, weight_map: Mapping[str, str]) -> None:
    def read(name):
        with _safe_open(os.path.join(path, weight_map[name])) as f:
            return f.get_tensor(name)

    emb_name = "model.embed_tokens.weight"
    lm, emb = read("lm_head.weight"), read(emb_name)
    if lm.shape != emb.shape or not np.array_equal(lm, emb):
        raise CheckpointError(
            f"{weight_map['lm_head.weight']}: tensor 'lm_head.weight' differs from {emb_name!r} but "
            "config.json has tie_word_embeddings=true; set it to false to load a separate LM head")


# ----------------------------------------------------------------------------- writing


def _architecture(model: Transformer) -> tuple[str, int | None]:
    return ("ForSequenceClassification", 1) if model.head == "score" else ("ForCausalLM", None)


def _nbytes(p) -> int:
    return int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize


def _shard(tensors: list[tuple[_Tensor, Any]], max_bytes: int) -> list[list[tuple[_Tensor, Any]]]:
    """Greedy split in order; a tensor larger than `max_bytes` gets a shard of its own."""
    shards: list[list[tuple[_Tensor, Any]]] = [[]]
    size = 0
    for t, p in tensors:
        if shards[-1] and size + _nbytes(p) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((t, p))
        size += _nbytes(p)
    return shards


def _write_shard(shard, fname: str) -> None:
    """Gathers one shard's tensors to host memory (only that shard's) and writes them."""
    from safetensors.numpy import save_file

    value = lambda p: p.get() if isinstance(p, _LayerOf) else p
    save_file({t.hf_name: t.to_hf(np.asarray(jax.device_get(value(p)))) for t, p in shard}, fname,
              metadata={"format": "pt"})


def move_into_place(tmp: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Rename the finished folder `tmp` to `out_dir` (a sibling); an existing `out_dir` is
    moved aside first and deleted only after the rename, so a reader never sees half of it."""
    out_dir = os.fspath(out_dir)
    old = None
    if os.path.exists(out_dir):
        old = os.path.join(os.path.dirname(os.path.abspath(out_dir)),
                           f".{os.path.basename(out_dir)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_pretrained(
    model: Transformer,
    params: Mapping,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: Any = None,
    generation_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Write `params` as a Hugging Face folder that transformers and `load_pretrained` load.

    Head "lm" is saved as `<Family>ForCausalLM`, "score" as `<Family>ForSequenceClassification`
    with `num_labels=1`, and "lm_value" as the causal LM *without* its value head (HF has no
    such class; save the value head separately if you need it). Tensors keep the params'
    dtype and are gathered to host memory one shard at a time (single-host). One
    `model.safetensors` if the tensors fit in `max_shard_bytes`, else shards
    `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`.

    The folder is written into a temporary sibling and renamed into place, so a crash
    never leaves a half-written checkpoint. An existing non-empty `out_dir` is an error
    unless `overwrite=True` (which replaces it). Returns `out_dir`.

    Args:
      tokenizer: saved alongside with its own `save_pretrained`, if given.
      generation_config: written to `generation_config.json`, if given.
    """
    config = model.config
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
    arch, num_labels = _architecture(model)
    head = "score" if model.head == "score" else "lm"
    if model.head == "lm_value":
        logger.info("save_pretrained: head 'lm_value' is saved as a causal LM; the value head is dropped")
    tensors = []
    for t in _trunk_tensors(config) + _head_tensors(config, head):
        p = _param_of(params, t, config)
        if tuple(p.shape) != t.shape:
            raise ValueError(f"params {'/'.join(t.path)} has shape {tuple(p.shape)}, expected {t.shape}")
        tensors.append((t, p))
    dtypes = {jnp.dtype(p.dtype).name for _, p in tensors}
    stored = dtypes.pop() if len(dtypes) == 1 else config.param_dtype
    if stored not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"params have dtype {stored}; expected float32, bfloat16 or float16")
    hf_dict = to_hf_dict(config.replace(param_dtype=stored), architecture=arch, num_labels=num_labels)
    hf_dict["dtype"] = hf_dict["torch_dtype"]

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_dict, f, indent=2, sort_keys=True)
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            _write_shard(shards[0], os.path.join(tmp, SAFE_WEIGHTS))
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_shard(shard, os.path.join(tmp, fname))
                weight_map.update({t.hf_name: fname for t, _ in shard})
            index = {"metadata": {"total_size": sum(_nbytes(p) for _, p in tensors)},
                     "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(tmp, SAFE_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        if generation_config is not None:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(dict(generation_config), f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def random_init(config: ModelConfig, *, head: str = "lm", seed: int = 0) -> tuple[Transformer, dict]:
    """A randomly initialised `(Transformer, params)`, HF-style: kernels and embeddings
    N(0, 0.02), norm gains one (Gemma: scales zero, its gain is 1 + w), biases zero.

    The same pytree as `init_params`, drawn with numpy tensor by tensor, without running
    (or compiling) a forward pass. A scanned config gets the same values, stacked
    (`stack_layers`).
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r}; expected one of {HEADS}")
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(config.param_dtype)
    params: dict = {}
    for t in _trunk_tensors(config) + _head_tensors(config, head):
        kind = t.path[-1]
        if kind == "scale":  # a norm's unit gain: 1, or 0 for Gemma's (1 + w)
            w = np.full(t.shape, 0.0 if config.norm_plus_one else 1.0, np.float32)
        elif kind == "bias":
            w = np.zeros(t.shape, np.float32)
        else:
            w = 0.02 * rng.standard_normal(t.shape, np.float32)
        _set(params, t.path, w if config.scan_layers else jnp.asarray(w, dtype))
    if config.scan_layers:
        params = jax.tree.map(lambda w: jnp.asarray(w, dtype), stack_layers(params))
    return Transformer(config, head), params


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: str | os.PathLike, *, chat_template: bool | str = True):
    """The tokenizer saved in a local folder (`transformers.AutoTokenizer`, no remote code).

    chat_template: True keeps the tokenizer's own chat template, False removes it (prompts
      are then encoded as plain text), a string installs that Jinja template.

    A truncated or corrupt tokenizer JSON file is a `CheckpointError` naming the file.
    """
    import transformers

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a local directory")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except json.JSONDecodeError as e:  # names no file: find the broken one
        for name in sorted(os.listdir(path)):
            if name.endswith(".json"):
                _read_json(os.path.join(path, name))
        raise CheckpointError(f"{path}: a tokenizer file is truncated or corrupt ({e})") from e
    if isinstance(chat_template, str):
        tok.chat_template = chat_template
    elif not chat_template:
        tok.chat_template = None
    return tok


def encode_prompt(
    tokenizer,
    prompt: str | list[Mapping[str, str]],
    *,
    use_chat_template: bool = True,
    system: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a prompt, through the chat template when asked for and available.

    `prompt` is a user message (str) or a list of `{"role", "content"}` messages. Without a
    chat template (or with `use_chat_template=False`) a str is encoded as plain text with
    the tokenizer's special tokens; messages need a template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    if not isinstance(prompt, str):
        raise ValueError("a list of messages needs a tokenizer with a chat template")
    if system is not None:
        raise ValueError("`system` needs a tokenizer with a chat template")
    return list(tokenizer(prompt)["input_ids"])
