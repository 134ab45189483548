"""A Bradley–Terry reward model on the built-in addition task's preference pairs.

    python -m jaxrlhf.train --config=configs/addition_reward_model.py --workdir=/tmp/addition_rm

SFT from scratch gives the trunk; the reward model (trunk + a new score head) then learns
to prefer correct answers over corrupted ones. Reports held-out pair accuracy; exports
the reward model as a `LlamaForSequenceClassification` folder.

Variants: `:tiny` (a few steps of each phase, for tests).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "reward_model"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.task(num_digits=2, num_train=8000, num_test=500, num_pairs=4000)
    c.model = base.model()
    c.sft = base.addition_warm_start()
    c.reward_model = base.pairs_phase("reward_model", steps=300, batch_size=64,
                                      optim=dict(lr=1e-3, schedule="cosine", warmup_steps=20))
    c.train = base.train(log_every=5, eval_every=50, checkpoint_every=100)
    if arg == "tiny":
        c.task.update(num_train=256, num_test=64, num_pairs=64)
        c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
        c.sft.steps, c.sft.batch_size = 3, 16
        c.reward_model.update(steps=3, batch_size=16)
        c.train.update(log_every=1, eval_every=2, checkpoint_every=2, progress=False, tensorboard=False)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
