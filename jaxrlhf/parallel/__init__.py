"""From one CPU to a TPU pod: meshes, sharding rules, sharded loading, multi-host helpers.

    mesh = make_mesh("data=-1,fsdp=4,tensor=2")
    state, state_sh = init_train_state_sharded(model, tx, rng, mesh, DEFAULT_RULES)
    step = jit_step(my_step, mesh=mesh, state_shardings=state_sh)
    state, metrics = step(state, shard_batch(batch, mesh), rng)
"""

from jaxrlhf.parallel import distributed
from jaxrlhf.parallel.loading import load_pretrained_sharded
from jaxrlhf.parallel.mesh import AXES, MeshConfig, batch_axis_size, make_mesh
from jaxrlhf.parallel.rules import (
    DEFAULT_RULES,
    FSDP_RULES,
    PRESETS,
    REPLICATED_RULES,
    IndivisibleError,
    MissingRuleError,
    abstract_params,
    abstract_state,
    batch_shardings,
    batch_spec,
    cache_shardings,
    constrain,
    constrain_batch,
    get_rules,
    init_sharded,
    init_train_state_sharded,
    jit_sharded,
    jit_step,
    kernel_mesh,
    logical_to_spec,
    match_shardings,
    optimizer_state_shardings,
    param_shardings,
    param_specs,
    place_state,
    put_sharded,
    replicated,
    shard_batch,
    state_shardings,
)
from jaxrlhf.parallel.sampling import generate_sharded

__all__ = [
    "AXES", "MeshConfig", "batch_axis_size", "make_mesh",
    "DEFAULT_RULES", "FSDP_RULES", "PRESETS", "REPLICATED_RULES", "IndivisibleError", "MissingRuleError",
    "abstract_params", "abstract_state", "batch_shardings", "batch_spec", "cache_shardings", "constrain", "constrain_batch",
    "get_rules", "init_sharded", "init_train_state_sharded", "jit_sharded", "jit_step", "kernel_mesh", "logical_to_spec",
    "match_shardings", "optimizer_state_shardings", "param_shardings", "param_specs", "place_state", "put_sharded",
    "replicated", "shard_batch", "state_shardings",
    "generate_sharded", "load_pretrained_sharded", "distributed",
]
