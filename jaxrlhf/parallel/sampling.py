"""The sampler compiled for a mesh: params in their shardings, prompts split by rows."""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrlhf.models.transformer import Transformer
from jaxrlhf.parallel.rules import DEFAULT_RULES, Rules, batch_spec, get_rules
from jaxrlhf.rollout.sampler import SampleOutput, _check, sample, tracks_behaviour


@functools.lru_cache(maxsize=32)
def _compiled(model, mesh, rules, params_treedef_and_shardings, rows, static):
    treedef, leaves = params_treedef_and_shardings
    p_sh = jax.tree.unflatten(treedef, leaves)
    row = lambda nd: NamedSharding(mesh, batch_spec(nd, mesh, rules, rows=rows, where="prompts"))
    n = rows * dict(static)["num_samples"]
    out_row = lambda nd: NamedSharding(mesh, batch_spec(nd, mesh, rules, rows=n, where="samples"))
    st = dict(static)
    tracked = tracks_behaviour(st.get("temperature", 1.0), st.get("top_k", 0), st.get("top_p", 1.0),
                               st.get("eos_id") if st.get("min_new_tokens", 0) > 0 else None)
    out_sh = SampleOutput(*(out_row(2),) * 7, out_row(1), out_row(2) if tracked else None)
    return jax.jit(functools.partial(sample, model, **dict(static)),
                   in_shardings=(p_sh, row(2), row(2), NamedSharding(mesh, P())), out_shardings=out_sh)


def generate_sharded(
    model: Transformer,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    mesh: Mesh,
    params_shardings,
    rules: Rules = DEFAULT_RULES,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    max_len: int | None = None,
) -> SampleOutput:
    """`rollout.generate` for a mesh: parameters stay in `params_shardings`, prompt rows
    (and the KV cache, which follows them and the kv-head-sharded projections) are split
    over `(data, fsdp)`, outputs come back row-sharded. Same tokens as the unsharded
    sampler up to float reassociation in the sharded matmuls. `B` must divide over the
    batch axes."""
    _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len)
    static = tuple(sorted(dict(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_k=int(top_k),
                               top_p=float(top_p), eos_id=eos_id, pad_id=int(pad_id), num_samples=int(num_samples),
                               max_len=max_len).items()))
    leaves, treedef = jax.tree.flatten(params_shardings)
    fn = _compiled(model, mesh, get_rules(rules), (treedef, tuple(leaves)), int(prompt_ids.shape[0]), static)
    return fn(params, prompt_ids, prompt_mask, rng)
