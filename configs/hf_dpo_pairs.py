"""DPO (or a reward model) of a local Hugging Face checkpoint on your own preference pairs.

    python -m jaxrlhf.train --config=configs/hf_dpo_pairs.py --workdir=/tmp/dpo \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct --config.task.path=/path/to/pairs.jsonl

Rows are TRL's preference layouts: `{"prompt", "chosen", "rejected"}` strings, or message
lists (`chosen` / `rejected` the assistant turn after the prompt's turns, or whole chats
without a `prompt` field), rendered through the tokenizer's chat template
(`data.pairs_from_records`). `--config.algorithm=reward_model` trains a Bradley–Terry
reward model on the same pairs instead (exported to `workdir/export`).

Variants: `:tiny` (a few steps; tests run it on a tiny random checkpoint and generated pairs).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "dpo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules
    c.task = base.jsonl_task(kind="pairs", prompt_key="prompt", max_prompt_tokens=512, max_response_tokens=512,
                             max_new_tokens=256)
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=0)
    c.dpo = base.pairs_phase("dpo", steps=500, batch_size=16, beta=0.1, optim=dict(lr=5e-7, warmup_steps=20))
    c.reward_model = base.pairs_phase("reward_model", steps=500, batch_size=16, optim=dict(lr=1e-5, warmup_steps=20))
    c.train = base.train(log_every=1, eval_every=100, checkpoint_every=100, eval_batch_size=64)
    if arg == "tiny":
        c.task.update(max_new_tokens=4)
        c.model.update(dtype="float32", remat="none", scan_layers=False)
        c.dpo.update(steps=2, batch_size=2)
        c.reward_model.update(steps=2, batch_size=2)
        c.train.update(eval_every=0, checkpoint_every=2, progress=False, tensorboard=False, eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
