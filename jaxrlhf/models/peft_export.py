"""LoRA adapters exported in PEFT's format: `save_peft` writes the folder that
`peft.PeftModel.from_pretrained(base, path)` loads onto the base model's Hugging Face export
(`models.hf_checkpoint`), `peft_tensors` gives its tensors. The adapters themselves are
`models.lora`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrlhf.models import lora
from jaxrlhf.models.hf_layout import unstack_layers

PyTree = Any


def peft_tensors(config, params: PyTree) -> dict[str, np.ndarray]:
    """The adapters under PEFT's names for a `*ForCausalLM` base:
    `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and
    `...lora_B.weight` `[out, r]` (`base_model.model.lm_head.lora_*` for the head), float32
    numpy arrays. A scanned stack is written per layer."""
    host = jax.tree.map(np.asarray, lora.adapters(params))
    if "layers" in host:
        host = unstack_layers(host)
    out = {}
    for path, node in lora.adapted_kernels(host):
        a, b = node["lora_a"], node["lora_b"]
        r = a.shape[-1]
        name = ".".join(p.replace("layers_", "layers.") for p in path)
        name = f"base_model.model.{name}" if path == (lora.LM_HEAD,) else f"base_model.model.model.{name}"
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T.astype(np.float32))
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T.astype(np.float32))
    return out


def save_peft(config, params: PyTree, path: str | Path, *, base_model_name_or_path: str = "") -> Path:
    """A PEFT adapter folder: `adapter_config.json` + `adapter_model.safetensors`, which
    `peft.PeftModel.from_pretrained(base, path)` loads onto the base model's HF export."""
    from safetensors.numpy import save_file

    lc = config.lora
    tensors = peft_tensors(config, params)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank, "lora_alpha": lc.alpha,
           "use_rslora": lc.rslora, "target_modules": modules, "lora_dropout": lc.dropout, "bias": "none",
           "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
           "base_model_name_or_path": base_model_name_or_path}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return path
