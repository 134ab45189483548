"""Tiny Hugging Face checkpoints shared by the model tests.

Each family is built once per session in PyTorch with *every* weight randomised (HF
initialises biases to zero and norm scales to one, which would hide a wrongly mapped bias
or norm), saved with `save_pretrained(safe_serialization=True)`, and read back by the tests.
Sizes are odd on purpose: 3 layers, 4 query / 2 kv heads, head_dim 16, vocab 300. The
families with local layers have a sliding window of 5, shorter than the test prompts.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300
PAD = 0
WINDOW = 5  # the sliding window of the families that have one

_COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=PAD,
               bos_token_id=1, eos_token_id=2, max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (config class, extra config fields)
FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling (original context 64 so that all three frequency
    # bands occur at head_dim 16), q/k/v/o biases, separate LM head.
    "llama3": ("LlamaConfig", dict(
        tie_word_embeddings=False, attention_bias=True, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000.0)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, rope_theta=1000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=WINDOW, rope_theta=1000.0)),
    "gemma": ("GemmaConfig", dict(hidden_act="gelu_pytorch_tanh", attention_bias=True)),
    # Gemma 2: layers local, global, local; caps small enough to bite on these activations.
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, a local rope base, linear rope scaling on the global layer only.
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}


def hf_config(family: str, **overrides):
    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(**{**_COMMON, **extra, **overrides})


def randomize_(model, seed: int) -> None:
    """Every weight random: matrices N(0, 0.1), biases N(0, 0.1), norm scales N(1, 0.2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if model.config.tie_word_embeddings and hasattr(model, "lm_head"):
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def build_hf(family: str, kind: str = "causal", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if kind == "causal":
        model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    else:
        model = transformers.AutoModelForSequenceClassification.from_config(
            hf_config(family, num_labels=1, **overrides))
    randomize_(model, seed)
    return model.eval()


def hf_forward(model, ids_BxL, mask_BxL):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids_BxL), attention_mask=torch.as_tensor(mask_BxL))
    return out.logits.float().numpy()


def right_padded_batch(seed: int = 0, lengths=(13, 9, 4, 1), max_len: int = 13):
    """Random ids in [3, V) with right padding; padded slots hold the pad id."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (len(lengths), max_len))
    mask = (np.arange(max_len)[None] < np.asarray(lengths)[:, None]).astype(np.int64)
    ids[mask == 0] = PAD
    return ids, mask


class _Store:
    """Session cache of saved checkpoints: (family, kind) -> (folder, torch model)."""

    def __init__(self, root):
        self.root, self.cache = root, {}

    def get(self, family: str, kind: str = "causal"):
        if (family, kind) not in self.cache:
            model = build_hf(family, kind, seed=len(self.cache))
            path = self.root / f"{family}-{kind}"
            model.save_pretrained(path, safe_serialization=True)
            self.cache[family, kind] = (str(path), model)
        return self.cache[family, kind]


@pytest.fixture(scope="session")
def hf_store(tmp_path_factory):
    torch.set_num_threads(1)
    return _Store(tmp_path_factory.mktemp("hf"))
