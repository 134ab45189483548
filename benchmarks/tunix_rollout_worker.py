"""Reference workload, measurement 1 with Google's Tunix sampler (`tunix.generate.sampler.Sampler`).

The workload: docs/benchmarks.md#the-reference-workload.

Run by `bench_rollout.py --tunix-python PY` in a separate environment that has
`google-tunix` (its dependencies conflict with none of ours, but it pulls in many):

    python -m venv /tmp/venv_tunix && /tmp/venv_tunix/bin/pip install "jax==<ours>" google-tunix
    python benchmarks/bench_rollout.py --tunix-python /tmp/venv_tunix/bin/python

The model is Tunix's own `Llama3` with the workload's sizes (vocab 512, hidden 256,
intermediate 688, 4 layers, 4/2 heads, head_dim 64) in float32 with its own random init
(which zeroes the MLP weights) and RoPE θ 1e6 (Tunix 0.1.7's Llama3 ignores
`ModelConfig.rope_theta`): neither changes the work timed, which does not depend on the
weight values or on a constant. Prompts are the workload's 16
rows given as word-level text without BOS (32 tokens each); EOS is a forbidden token, so
every row gets exactly 64 new tokens, as `min_new_tokens=64` does for transformers.
Prints one JSON line: per-call wall seconds of `sampler(...)` after warm-up.

`--shape smollm2 --new-tokens N` (from `bench_rollout.py --shape smollm2`): the same
sampler on a SmolLM2-135M-shaped Llama3 (30 layers, 576 wide, 1536 MLP, 9/3 heads of 64,
V = 49,152, tied embeddings, RoPE θ 1e5 as given), N new tokens per row, and a word-level
vocabulary that names every id of V.

`--dtype bfloat16` (from `bench_gpu.py --tunix-python`): the model's parameters cast to
bf16 after its init, so that it computes in bf16 and its sampler keeps a bf16 KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def tunix_config(shape: str) -> dict:
    """`_common.SHAPES[shape]` over the workload's Llama, in Tunix's `llama3.ModelConfig` field names."""
    hf = {**_common.LLAMA, **_common.SHAPES[shape]}
    return dict(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
                hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
                num_kv_heads=hf["num_key_value_heads"], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
                weight_tying=hf["tie_word_embeddings"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--shape", choices=sorted(_common.SHAPES), default="workload")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's parameters (and so its compute and its sampler's KV cache)")
    args = ap.parse_args()

    import jax
    import tunix
    from flax import nnx
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as llama3

    cfg = llama3.ModelConfig(**tunix_config(args.shape))
    model = llama3.Llama3(cfg, rngs=nnx.Rngs(params=0))
    if args.dtype != "float32":  # the sampler takes its cache dtype from the parameters'
        nnx.update(model, jax.tree.map(lambda x: x.astype(args.dtype), nnx.state(model, nnx.Param)))
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cache = 128 if args.shape == "workload" else 32 + args.new_tokens
    sampler = sampler_lib.Sampler(model, tokenizer, sampler_lib.CacheConfig(
        cache_size=cache, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))

    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"])
    rows = np.concatenate([prompts] * (-(-args.batch // len(prompts))))[:args.batch]
    texts = [" ".join(f"t{int(t)}" for t in row) for row in rows]
    assert sampler.tokenize(texts[0]).tolist() == rows[0].tolist(), "prompt must be the 32 workload ids, no BOS"

    def call(seed):
        out = sampler(texts, max_generation_steps=args.new_tokens, max_prompt_length=32, temperature=1.0, top_p=1.0,
                      forbidden_tokens=[2], seed=seed, pad_output=True)
        return out

    t0 = time.perf_counter()
    out = call(0)
    first_s = time.perf_counter() - t0
    new_tokens = [len(t) for t in out.tokens]
    for i in range(args.warmup - 1):
        call(1 + i)
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        call(100 + i)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"impl": "tunix", "B": args.batch, "times": times, "first_call_s": first_s,
                      "new_tokens_per_row": sorted(set(new_tokens)), "tunix": getattr(tunix, "__version__", "?"),
                      "jax": jax.__version__, "dtype": str(sampler.dtype),
                      "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
