"""SFT of a local Hugging Face chat checkpoint on your own chats (TRL's `messages` rows).

    python -m jaxrlhf.train --config=configs/hf_sft_messages.py --workdir=/tmp/sft \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct --config.task.path=/path/to/chats.jsonl

Rows are `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}`
(or `{"prompt": ..., "completion": ...}`), rendered through the tokenizer's chat template;
the loss is on the assistant turns only (`data.sft_from_records`). `task.path` may mix
files and TFDS datasets by weight (`data.sources`). Held-out evaluation decodes each chat's
prompt (up to its first assistant turn) and compares the final answer with that turn's.

Variants: `:tiny` (a few steps; tests run it on a tiny random checkpoint and generated chats).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "sft"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules
    c.task = base.jsonl_task(kind="sft", prompt_key="prompt", max_prompt_tokens=512, max_response_tokens=1024, max_new_tokens=256)
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=500, batch_size=16, optim=dict(lr=1e-5, schedule="cosine", warmup_steps=20))
    c.train = base.train(log_every=1, eval_every=100, checkpoint_every=100, eval_batch_size=64)
    if arg == "tiny":
        c.task.update(max_new_tokens=4)
        c.model.update(dtype="float32", remat="none", scan_layers=False)
        c.sft.update(steps=2, batch_size=2)
        c.train.update(eval_every=0, checkpoint_every=2, progress=False, tensorboard=False, eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
