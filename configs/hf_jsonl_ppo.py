"""PPO on your own JSONL prompts from a local Hugging Face checkpoint, scored by the task's
answer check plus any Python rewards you name (no reward model).

    python -m jaxrlhf.train --config=configs/hf_jsonl_ppo.py --workdir=/tmp/ppo_jsonl \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \\
        --config.task.path=/path/to/train.jsonl --config.task.test_path=/path/to/test.jsonl \\
        --config.reward.fns=my_rewards:correct,my_rewards:short --config.reward.weights=1.0,0.2

Rows are JSON objects with "question" and "answer" (the GSM8K layout; change the names
with `task.prompt_key` / `task.answer_key`); prompts go through the tokenizer's chat
template. The reward is the task's exact final answer (`data.final_answer_reward`) ×
`reward.task_weight` plus each function of `reward.fns` × its weight, all computed on the
host on the decoded text between the compiled rollout and the compiled PPO update
(`ppo.reward="task"`): a reward function takes TRL's `reward_funcs` arguments,
`fn(prompts=..., completions=..., **row_fields) -> list[float]`, its module on
PYTHONPATH. The critic starts from the policy's trunk with a fresh value head; the KL
penalty to the frozen reference goes into the per-token reward (k1, β = 0.05).
On a 2-core CPU this is for smoke runs only (use `:tiny`).

Variants: `:tiny` (a few steps with short generations; tests run it on a tiny random
checkpoint and generated data).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "ppo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.jsonl_task(prompt_key="question", answer_key="answer", max_prompt_tokens=256, max_new_tokens=256,
                             chat_template=True, system_prompt="Reason step by step; end with '#### <answer>'.")
    c.reward = base.reward()  # Python rewards beside the task's: --config.reward.fns=pkg.mod:fn
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=0)
    c.ppo = base.ppo(steps=300, prompts_per_step=32, sampling=dict(max_new_tokens=256, num_samples=1),
                     reward="task", beta=0.05, num_ppo_epochs=2, num_minibatches=4, missing_eos_penalty=1.0,
                     optim=dict(lr=1e-6, schedule="cosine", warmup_steps=10), critic_optim=dict(lr=1e-5))
    c.train = base.train(log_every=1, eval_every=50, checkpoint_every=50, eval_batch_size=64)
    if arg == "tiny":
        c.task.update(max_prompt_tokens=48, max_new_tokens=6, chat_template=False, system_prompt="")
        c.model.update(dtype="float32", remat="none")
        c.ppo.update(steps=2, prompts_per_step=4, num_minibatches=1, num_ppo_epochs=1)
        c.ppo.sampling.update(max_new_tokens=6)
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False,
                       eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
