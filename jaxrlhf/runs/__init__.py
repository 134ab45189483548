"""Runs: a config in, a trained (and exported) model out — `train_and_evaluate`.

    from jaxrlhf.runs import train_and_evaluate
    from configs import addition_grpo
    summary = train_and_evaluate(addition_grpo.get_config("tiny"), "/tmp/run")
"""

from jaxrlhf.runs.experiment import train_and_evaluate

__all__ = ["train_and_evaluate"]
