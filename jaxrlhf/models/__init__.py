"""Decoder models for the four RLHF roles, configured from Hugging Face checkpoints."""

from jaxrlhf.models.hf_checkpoint import (
    CheckpointError,
    encode_prompt,
    load_generation_config,
    load_pretrained,
    load_tokenizer,
    random_init,
    save_pretrained,
)
from jaxrlhf.models._kernels import decode_compiler_options, vocab_major_decode_head
from jaxrlhf.models.hf_layout import hf_tensor_map, stack_layers, unstack_layers
from jaxrlhf.models.config import REMAT_POLICIES, ModelConfig, RopeScaling, UnsupportedConfigError, from_hf_config, to_hf_dict
from jaxrlhf.models.transformer import (
    HEADS,
    KVCache,
    ModelOutput,
    Transformer,
    count_params,
    grow_cache,
    init_cache,
    init_params,
    lm_head_rows,
    logical_axes,
    positions_from_mask,
    project_logits,
    score_at_last_token,
    vocab_major_logits,
)

__all__ = [
    "CheckpointError", "decode_compiler_options", "encode_prompt", "hf_tensor_map", "load_generation_config",
    "load_pretrained", "load_tokenizer", "random_init", "save_pretrained", "vocab_major_decode_head",
    "HEADS", "KVCache", "REMAT_POLICIES", "ModelConfig", "ModelOutput", "RopeScaling", "Transformer",
    "UnsupportedConfigError", "count_params", "from_hf_config", "grow_cache", "init_cache", "init_params",
    "lm_head_rows", "logical_axes", "positions_from_mask", "project_logits", "score_at_last_token", "stack_layers",
    "to_hf_dict", "unstack_layers", "vocab_major_logits",
]
