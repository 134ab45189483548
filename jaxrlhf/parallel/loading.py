"""Hugging Face checkpoints loaded tensor by tensor straight into their shards."""

from __future__ import annotations

import os

from jax.sharding import Mesh

from jaxrlhf.models.hf_checkpoint import load_pretrained
from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.rules import DEFAULT_RULES, Rules, get_rules, param_shardings


def load_pretrained_sharded(
    path: str | os.PathLike,
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    on_indivisible: str = "error",
    **kwargs,
) -> tuple[Transformer, dict]:
    """`load_pretrained(path, **kwargs)` with every parameter born sharded on `mesh`.

    The shardings come from the model's logical axes and `rules`. Each parameter is built
    with `jax.make_array_from_callback`: a device's callback reads only its slice of the
    safetensors tensor (`safe_open(...).get_slice(name)[rows, cols]`, the HF `[out, in]`
    layout mapped to our `[in..., out...]` kernels), so no host ever holds the whole model;
    with several processes each reads only the shards of its own devices.

    kwargs: `dtype`, `param_dtype`, `head`, `seed` and the model options as in `load_pretrained`.
    Errors are `load_pretrained`'s: a truncated or corrupt shard is a `CheckpointError`
    naming that shard's file.
    """
    rules = get_rules(rules)
    return load_pretrained(path, shardings=lambda model: param_shardings(model, mesh, rules,
                                                                          on_indivisible=on_indivisible),
                           **kwargs)
