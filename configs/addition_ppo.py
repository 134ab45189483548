"""The built-in addition task with RLHF-PPO and four models.

    python -m jaxrlhf.train --config=configs/addition_ppo.py --workdir=/tmp/addition_ppo

SFT from scratch (the actor, and the reference as its frozen copy); then the reward model's
own trunk: a copy of the SFT trunk trained 2,400 more SFT steps (`reward_model.sft_steps`;
0.954-0.976 held-out exact match, where the policy has 0.69-0.78); then the reward model on
that trunk, trained on the SFT policy's own right and wrong answers ranked by the task's
rule (`reward_model.pairs="policy"`, 8 samples per training prompt, InstructGPT's recipe)
at lr 1e-4 for 1,000 steps; then PPO with a critic on the policy's trunk (lr 1e-5, KL
coefficient 0.5). The run reports the reward-model score (`reward/mean`) beside the true
held-out exact match (`eval/accuracy`). The guard (`train.stop_metric="accuracy"`,
`keep_best`): PPO ends with the policy of its best held-out evaluation, the SFT point
included, so it never ends below where it began.

Measured 2026-12-03 on 2 shared cores (seeds 0 / 1 / 2; exact match after SFT, then the PPO
evaluations at steps 20 / 40 / 60 / 80 / 100; the reward model's held-out accuracy on the
policy's own pairs; wall time): 0.738 -> 0.770 / 0.760 / 0.764 / 0.790 / 0.780 (0.894;
394 s with SFT and trunk restored), 0.778 -> 0.792 / 0.798 / 0.810 / 0.826 / 0.826 (0.685;
638 s), 0.686 -> 0.728 / 0.726 / 0.710 / 0.716 / 0.726 (0.719; 627 s). The last
evaluation, not selected, is +4.2 / +4.8 / +4.0 points above the SFT point (one standard
error 0.018).

More runs: docs/results.md#addition_ppopy--rlhf-ppo-with-a-learned-reward-model

Variants: `:tiny` (a few steps of each phase, for tests; synthetic pairs, no trunk of its own).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "ppo"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.task(num_digits=2, num_train=8000, num_test=500, num_pairs=9000)
    c.model = base.model()
    c.sft = base.addition_warm_start()
    # The reward model: its own trunk trained 2,400 SFT steps further than the policy's, then the
    # policy's own right/wrong answers (8 samples per prompt; the held-out prompts' pairs give
    # eval/policy_pairs/accuracy) at lr 1e-4, which keeps what the trunk learnt (docs/training.md).
    c.reward_model = base.pairs_phase("reward_model", steps=1000, batch_size=64, pairs="policy", samples_per_prompt=8,
                                      sft_steps=2400, optim=dict(lr=1e-4, schedule="cosine", warmup_steps=20))
    c.ppo = base.ppo(steps=100, prompts_per_step=64, sampling=dict(max_new_tokens=4),
                     beta=0.5, num_ppo_epochs=2, optim=dict(lr=1e-5), critic_optim=dict(lr=1e-3))
    # The guard against reward over-optimisation: PPO ends with the policy of its best
    # held-out evaluation, the SFT starting point included (docs/training.md).
    c.train = base.train(log_every=5, eval_every=20, checkpoint_every=50, stop_metric="accuracy", stop_patience=5,
                         keep_best=True)
    if arg == "tiny":
        c.task.update(num_train=256, num_test=64, num_pairs=64)
        c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
        c.sft.steps, c.sft.batch_size = 3, 16
        # a 3-step SFT policy samples no pair: the task's synthetic pairs, and the policy's trunk
        c.reward_model.update(steps=3, batch_size=16, pairs="task", samples_per_prompt=0, sft_steps=0)
        c.ppo.update(steps=3, prompts_per_step=8)
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False,
                       stop_metric=None, stop_patience=0, keep_best=False)  # the guard off: tests set it themselves
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
