"""GRPO on GSM8K-style math from a local Hugging Face checkpoint (e.g. Qwen2.5-0.5B-Instruct).

    python -m jaxrlhf.train --config=configs/hf_gsm8k_grpo.py --workdir=/tmp/gsm8k \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \\
        --config.task.path=/path/to/gsm8k_train.jsonl --config.task.test_path=/path/to/gsm8k_test.jsonl

Rows are JSON objects with "question" and "answer" (the GSM8K solution ending in
"#### 72", or a bare number); prompts go through the tokenizer's chat template, and the
reward is 1 when the response's final answer ("#### x", \\boxed{x} or its last number)
equals the reference's — computed on the host, between the compiled rollout and update.
The weights load from safetensors only; the final policy is exported to `workdir/export`.
The layer stack runs as one scan with each layer rematerialised (`scan_layers`, `remat`),
for a shorter first step (compile) and a lower peak RSS (measured in
docs/benchmarks.md#first-grpo-step-on-a-real-checkpoint-compile-time-and-peak-rss);
checkpoints are exported per layer as usual.
On a 2-core CPU this is for smoke runs only (use `:tiny`); on a GPU/TPU expect the
held-out exact-answer accuracy to rise over the first few hundred steps.

Variants: `:tiny` (a few steps with short generations; tests run it on a tiny random
checkpoint and generated data).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.jsonl_task(prompt_key="question", answer_key="answer", max_prompt_tokens=256, max_new_tokens=256,
                             chat_template=True, system_prompt="Reason step by step; end with '#### <answer>'.")
    c.reward = base.reward()  # Python rewards beside the task's: --config.reward.fns=pkg.mod:fn
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=0)
    c.grpo = base.grpo(steps=500, prompts_per_step=32, sampling=dict(max_new_tokens=256, num_samples=8,
                                                                     temperature=1.0),
                       advantage="grpo", beta=0.04, agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28,
                       num_minibatches=4, optim=dict(lr=1e-6, schedule="cosine", warmup_steps=20))
    c.train = base.train(log_every=1, eval_every=50, checkpoint_every=50, eval_batch_size=64)
    if arg == "tiny":
        c.task.update(max_prompt_tokens=48, max_new_tokens=6, chat_template=False, system_prompt="")
        c.model.update(dtype="float32", remat="none")
        c.grpo.update(steps=2, prompts_per_step=4, num_minibatches=1)
        c.grpo.sampling.update(max_new_tokens=6, num_samples=2)
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False,
                       eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
