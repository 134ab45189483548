"""Supervised fine-tuning on the built-in addition task, from scratch.

    python -m jaxrlhf.train --config=configs/addition_sft.py --workdir=/tmp/addition_sft

Masked cross-entropy on the answer tokens only; reports held-out exact-match accuracy
(greedy) before and after.

Variants: `:tiny` (a few steps, for tests).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.mlc.ConfigDict()
    c.algorithm = "sft"
    c.seed = 0
    base.parallel(c)  # c.mesh, c.rules: the device mesh and sharding rules (defaults: data=-1, fsdp_tp)
    c.task = base.task(num_digits=2, num_train=8000, num_test=500)
    c.model = base.model()
    c.sft = base.sft(steps=1000, batch_size=64, optim=dict(lr=3e-3, schedule="cosine", warmup_steps=50,
                                                            end_lr_ratio=0.1))
    c.train = base.train(log_every=10, eval_every=100, checkpoint_every=200)
    if arg == "tiny":
        c.task.update(num_train=256, num_test=64)
        c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
        c.sft.update(steps=6, batch_size=16)
        c.train.update(log_every=1, eval_every=3, checkpoint_every=3, progress=False, tensorboard=False)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; expected 'tiny' or none")
    c.lock()
    return c
