"""Episodes' environments: the contract (`base`), at the text and token levels."""

from jaxrlhf.envs.base import (Env, EnvError, EnvLimit, Step, TokenEnv, TokenStep, check_ids, check_messages, check_step,
                               check_token_step, close, import_env, name_of)

__all__ = ["Env", "EnvError", "EnvLimit", "Step", "TokenEnv", "TokenStep", "check_ids", "check_messages", "check_step",
           "check_token_step", "close", "import_env", "name_of"]
