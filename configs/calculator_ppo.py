"""The built-in multi-turn tool task with PPO in place of GRPO: sums with a calculator, SFT
on demonstrations, then PPO on episodes, with a critic.

    python -m jaxrlhf.train --config=configs/calculator_ppo.py --workdir=/tmp/calculator_ppo

calculator_grpo.py's recipe (the same task, environment, model and SFT on the imperfect
expert's demonstrations) with its GRPO phase replaced by PPO on the same episodes
(docs/episodes.md#ppo-on-episodes): the environment's reward (`ppo.reward="task"`, the
episode's, logged as `reward/env`) on the last policy token, GAE over the policy's tokens
only (the environment's tokens neither discount nor cut the chain, and the critic's values
on them are never read), the critic a copy of the policy's trunk with a fresh score head.
As many episodes a step as GRPO's (128, one per problem: no groups), β = 0 as there, the
same actor learning rate (3e-4 cosine), the critic's 1e-3; 2 epochs of 2 minibatches.

Not measured yet: no full run of this recipe has been made, so nothing is claimed about its
held-out exact match against calculator_grpo.py's.

Variants: `:tiny` (calculator_grpo.py's tiny SFT and 3 PPO steps of 8 episodes, for tests).
"""

from jaxrlhf.runs import config_base as base


def get_config(arg=None):
    c = base.recipe(__file__, "calculator_grpo", arg)  # the recipe, its variants included
    c.algorithm = "ppo"
    del c["grpo"]
    c.ppo = base.ppo(steps=100, prompts_per_step=128, reward="task", beta=0.0, num_ppo_epochs=2, num_minibatches=2,
                     optim=dict(lr=3e-4, schedule="cosine", warmup_steps=10), critic_optim=dict(lr=1e-3))
    if arg == "tiny":
        c.ppo.update(steps=3, prompts_per_step=8)
    c.lock()
    return c
