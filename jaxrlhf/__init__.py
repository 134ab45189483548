"""jaxrlhf: reinforcement learning on large language models, as small composable JAX functions."""

__version__ = "0.1.0"
