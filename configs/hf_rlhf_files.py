"""The RLHF pipeline on your own files: SFT on chats, a reward model on preference pairs,
then PPO (four models) on prompts, from a local Hugging Face chat checkpoint.

    python -m jaxrlhf.train --config=configs/hf_rlhf_files.py --workdir=/tmp/rlhf \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct --config.task.path=/path/to/prompts.jsonl \\
        --config.task.sft_path=/path/to/chats.jsonl --config.task.pairs_path=/path/to/pairs.jsonl

`task.path`: `{"prompt": ..., "answer": ...}` rows for PPO (the answer is what held-out
evaluation's exact-answer check compares); `task.sft_path`: `{"messages": [...]}` chats
(or prompt/completion rows) for the SFT warm start, learnt on their assistant turns;
`task.pairs_path`: `{"prompt", "chosen", "rejected"}` rows (strings or message lists) for
the reward model, which then scores PPO's responses. Each path may mix files and TFDS
datasets by weight (`data.sources`); every prompt goes through the chat template and is
padded to one width. The KL penalty to the SFT policy goes into the per-token reward.
On a 2-core CPU this is for smoke runs only (use `:tiny`); no result is claimed here.

Variants: `:tiny` (a few steps of each phase; tests run it on a tiny random checkpoint and
generated files).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "ppo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules
    c.task = base.jsonl_task(prompt_key="prompt", answer_key="answer", max_prompt_tokens=512,
                             max_response_tokens=1024, max_new_tokens=256)
    c.reward = base.reward()  # Python rewards beside the task's: --config.reward.fns=pkg.mod:fn
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=500, batch_size=16, optim=dict(lr=1e-5, schedule="cosine", warmup_steps=20))
    c.reward_model = base.pairs_phase("reward_model", steps=500, batch_size=16,
                                      optim=dict(lr=1e-5, schedule="cosine", warmup_steps=20))
    c.ppo = base.ppo(steps=300, prompts_per_step=32, sampling=dict(max_new_tokens=256), beta=0.05,
                     num_ppo_epochs=2, num_minibatches=4, missing_eos_penalty=1.0,
                     optim=dict(lr=1e-6, schedule="cosine", warmup_steps=10), critic_optim=dict(lr=1e-5))
    c.train = base.train(log_every=1, eval_every=50, checkpoint_every=50, eval_batch_size=64)
    if arg == "tiny":
        c.task.update(max_new_tokens=4)
        c.model.update(dtype="float32", remat="none", scan_layers=False)
        c.sft.update(steps=2, batch_size=4)
        c.reward_model.update(steps=2, batch_size=4)
        c.ppo.update(steps=2, prompts_per_step=4, num_minibatches=1, num_ppo_epochs=1)
        c.ppo.sampling.update(max_new_tokens=4)
        c.train.update(eval_every=0, checkpoint_every=2, progress=False, tensorboard=False, eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
