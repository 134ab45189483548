"""Tiny tokenizers with real chat templates, for the episode tests (no downloads); imported
by the test files of this folder (`sys.path`), like tests/parallel/_runner.py.

`tiny_tokenizer(name)`: a byte-level BPE (any text encodes; decoding a sequence gives back
its text) trained on the fly on a few sentences, with the special tokens of the template
`name` added as special tokens, and that template (tests/fixtures/chat_templates/) as its
`chat_template`. `TEMPLATES` names each fixture's file, special tokens, end-of-turn
token, and its tool call format (`jaxrlhf.envs.tools.FORMATS`).
"""

from __future__ import annotations

import functools
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

_CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATES = {
    "qwen2.5": dict(file="Qwen-Qwen2.5-7B-Instruct.jinja", special=_CHATML, bos=None, eos="<|im_end|>",
                    stop="<|im_end|>", format="hermes"),
    "qwen3": dict(file="Qwen-Qwen3-0.6B.jinja", special=_CHATML, bos=None, eos="<|im_end|>", stop="<|im_end|>",
                  format="hermes"),
    "llama3.1": dict(file="meta-llama-Llama-3.1-8B-Instruct.jinja",
                     special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|eom_id|>", "<|python_tag|>"],
                     bos="<|begin_of_text|>", eos="<|eot_id|>", stop="<|eot_id|>", format="llama3"),
    "mistral-nemo": dict(file="mistralai-Mistral-Nemo-Instruct-2407.jinja",
                         special=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                         bos="<s>", eos="</s>", stop="</s>", format="mistral"),
    "smollm2": dict(file="HuggingFaceTB-SmolLM2-135M-Instruct.jinja", special=["<|im_start|>", "<|im_end|>"],
                    bos="<|im_start|>", eos="<|im_end|>", stop="<|im_end|>", format="prompt"),
    "gemma3": dict(file="google-gemma-3-it.jinja", special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
                   bos="<bos>", eos="<eos>", stop="<end_of_turn>", format="prompt"),
}

_CORPUS = [
    "You are a helpful assistant. What is 2 + 3, then times 4? The answer is 20.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    '{"name": "mul", "parameters": {"a": 5, "b": 4}}',
    "system user assistant tool ipython model\n\n Tools Environment: Cutting Knowledge Date",
]


@functools.lru_cache(maxsize=None)
def _base_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(name: str):
    """A byte-level BPE tokenizer with the chat template `name` of `TEMPLATES` (cached)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = TEMPLATES[name]
    named = {k: spec[k] for k in ("bos", "eos") if spec[k]}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_base_tokenizer()),
        **{f"{k}_token": v for k, v in named.items()},
        additional_special_tokens=[t for t in spec["special"] if t not in named.values()],
        name_or_path=f"tiny-{name}")
    tokenizer.chat_template = (FIXTURES / spec["file"]).read_text()
    return tokenizer

