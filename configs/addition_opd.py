"""On-policy distillation on the built-in addition task: a 1-layer student learns from the
default recipe's 2-layer policy.

    python -m jaxrlhf.train --config=configs/addition_grpo.py --workdir=/tmp/addition_grpo   # the teacher
    python -m jaxrlhf.train --config=configs/addition_opd.py --workdir=/tmp/addition_opd \\
        --config.opd.teacher_path=/tmp/addition_grpo/export

The teacher is the export of the default recipe (`configs/addition_grpo.py`: 2 layers,
width 128, SFT then GRPO), a Hugging Face folder with the task's character tokenizer; the
student has half its layers (1 layer, width 128), starts from scratch, takes the default
recipe's SFT warm start, then 2,000 OPD steps: each samples 4 answers to each of 64 prompts,
the teacher scores every sampled token, and the per-token advantage is
`sg(teacher_logp − old_logp)` (docs/opd.md, docs/concepts.md#on-policy-distillation) in
GRPO's clipped loss; `distill/reverse_kl` is the per-token reverse KL(student‖teacher) on
the student's samples. The task's reward is measured (`reward/mean`) but not trained on
(`--config.opd.task_weight=λ` adds λ × its GRPO advantage). `opd.teacher_path` defaults to
`/tmp/addition_grpo/export`, where the first command leaves it; `base` distils a LoRA
student from its own base.

Measured 2026-12-06 on a 2-core AMD EPYC VM shared with other jobs, seed 0 only, with a
teacher export of the default recipe (seed 0, 0.966 held-out exact match): the student's
held-out greedy exact match 0.552 after SFT -> 0.870 after OPD (+31.8 points; 0.862 first
reached at OPD step 1,800, 0.123 s a step), 304 s in all. The default GRPO recipe on the
same student from the same warm start (`configs/addition_grpo.py --config.model.num_layers=1`:
1,500 steps of 192 pooled prompts x 8 samples with guidance, 0.219 s a step) ended at 0.862,
first reached at its step 1,300: OPD reached GRPO's figure after ~221 s of steps against
GRPO's ~285 s (both runs on the same loaded machine, minutes apart: not a side-by-side
timing). Neither comes within 5 points of the teacher: at one layer both level off near
0.86-0.87. With 500 OPD steps (this config's earlier setting) the student reached 0.758.
`benchmarks/opd_addition.py` runs the comparison for more seeds.

Variants: `:tiny` (a few steps of each phase, a 1-layer width-32 student, for tests; the
test gives it a teacher folder: `opd.teacher_path` is empty).
"""

from jaxrlhf.runs import config_base as base
from jaxrlhf.runs import sections


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "opd"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.task(num_digits=2, num_train=8000, num_test=500, partial_credit=0.5)
    c.reward = base.reward()
    c.model = base.model(num_layers=1)  # the student: half the default model's 2 layers, width 128
    c.sft = base.addition_warm_start()
    c.opd = base.section(*sections.PHASE_SECTIONS["opd"], steps=2000, prompts_per_step=64,
                         teacher_path="/tmp/addition_grpo/export", sampling=dict(max_new_tokens=4, num_samples=4),
                         agg="token-mean", optim=dict(lr=3e-4, schedule="cosine", warmup_steps=10))
    c.train = base.train(log_every=10, eval_every=100, checkpoint_every=250)
    if arg == "tiny":
        c.task.num_train, c.task.num_test = 256, 64
        c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
        c.sft.steps, c.sft.batch_size = 4, 16
        c.opd.update(steps=3, prompts_per_step=4, teacher_path="")
        c.opd.sampling.num_samples = 2
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
