"""GRPO on your own environment, multi-turn, from a local Hugging Face checkpoint with a
chat template (e.g. Qwen2.5-0.5B-Instruct).

    python -m jaxrlhf.train --config=configs/env_grpo.py --workdir=/tmp/env_grpo \\
        --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \\
        --config.env.cls=my_envs:Arithmetic --config.env.tools=my_envs:add,my_envs:mul \\
        --config.task.path=train.jsonl --config.task.test_path=test.jsonl

`env.cls` is a class made with no arguments once per episode (with `env.tools`:
`cls(tools=[...])`, an `envs.ToolEnv` subclass), its module on PYTHONPATH. A text
environment (`reset(row) -> messages`, `step(assistant_text) -> Step`) runs through the
checkpoint's chat template with exact tokens (`envs.ChatEpisode`); each JSONL row is handed
to its `reset`. The episode's reward is the environment's (`reward/env`); the episodes'
figures are logged as `episode/...` (docs/episodes.md#from-the-command-line). A turn ends
at the tokenizer's EOS or an `eos_token_id` of the folder's `generation_config.json`
(Qwen's `<|im_end|>`).

Variants: `:tiny` (a few steps with short episodes; tests run it on a tiny random checkpoint).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "grpo"
    c.seed = 0
    base.parallel(c)
    c.task = base.env_task(max_prompt_tokens=512)
    c.env = base.env(max_turns=4, max_turn_tokens=256, max_total_tokens=1024, max_env_tokens=256)
    c.reward = base.reward()
    c.model = base.model(path="", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True)
    c.sft = base.sft(steps=0)
    c.grpo = base.grpo(steps=200, prompts_per_step=16, sampling=dict(num_samples=8, temperature=1.0),
                       advantage="grpo", beta=0.0, agg="token-mean", optim=dict(lr=1e-6, schedule="cosine",
                                                                                warmup_steps=10))
    c.train = base.train(log_every=1, eval_every=50, checkpoint_every=50, eval_samples=0)
    if arg == "tiny":
        c.task.max_prompt_tokens = 160
        c.env.update(max_turns=3, max_turn_tokens=4, max_total_tokens=96, max_env_tokens=48)
        c.model.update(dtype="float32", remat="none", scan_layers=False)
        c.grpo.update(steps=2, prompts_per_step=2)
        c.grpo.sampling.num_samples = 4
        c.train.update(log_every=1, eval_every=0, checkpoint_every=2, progress=False, tensorboard=False,
                       export=False)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
