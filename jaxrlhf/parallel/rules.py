"""Logical-axis sharding rules: parameters, optimizer state, batch, activations, KV cache.

Every parameter of `Transformer` names its axes (`vocab`, `embed`, `q_heads`, `kv_heads`,
`head_dim`, `mlp`, `norm`; `None` for the 1-wide score/value head axis; `layers` for the
leading axis of a scanned stack's parameters and KV cache). A *rule set* is an
ordered tuple of `(logical name, mesh axes)` pairs; the first pair naming an axis wins, and
its mesh axes are `None` (replicated), one mesh axis name, or a tuple of them:

    DEFAULT_RULES = (("batch", ("data", "fsdp")),   # activations / batch rows
                     ("embed", "fsdp"),             # FSDP: parameters split on the model dim
                     ("vocab", "tensor"), ("q_heads", "tensor"), ("kv_heads", "tensor"),
                     ("mlp", "tensor"),             # Megatron-style tensor parallelism
                     ("head_dim", None), ("norm", None),
                     ("layers", None))             # a scanned stack: each device all layers

A logical axis with no rule is an error naming the parameter and the axis; nothing is
replicated silently. A dimension that its mesh axes do not divide is an error too, unless
`on_indivisible="replicate"`, which replicates that dimension and logs a warning (the KV
cache always does this for kv heads, see `cache_shardings`).

Each role (actor, critic, reference, reward model) can use its own rule set, e.g.
`REPLICATED_RULES` for a small reward model next to an FSDP+TP actor.

The sharding recipe (as in nanodo / big_vision): `jax.eval_shape(init)` → rules →
`jax.jit(init, out_shardings=...)` so parameters are born sharded (`init_sharded`); the
step is `jax.jit(step, in_shardings, out_shardings, donate_argnames=("state",))` with a
sharding constraint on the batch (`jit_step`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrlhf.models import attention
from jaxrlhf.models.transformer import Transformer, init_params

logger = logging.getLogger(__name__)

PyTree = Any
# A rule set: ((logical axis, None | mesh axis | tuple of mesh axes), ...), first match wins.
Rules = tuple

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("cache_length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)
"""FSDP on the model dimension + tensor parallelism on heads / MLP / vocabulary."""

FSDP_RULES: Rules = (
    ("batch", ("data", "fsdp", "tensor")),
    ("length", None),
    ("cache_length", None),
    ("vocab", None),
    ("embed", ("fsdp", "tensor")),
    ("q_heads", None),
    ("kv_heads", None),
    ("mlp", None),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)
"""Pure ZeRO-3-style sharding: every device holds a slice of the model dimension."""

REPLICATED_RULES: Rules = (
    ("batch", ("data", "fsdp", "tensor")),
    ("length", None),
    ("cache_length", None),
    ("vocab", None),
    ("embed", None),
    ("q_heads", None),
    ("kv_heads", None),
    ("mlp", None),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)
"""Data parallelism only: a full copy of the parameters on every device."""

PRESETS = {"fsdp_tp": DEFAULT_RULES, "fsdp": FSDP_RULES, "replicated": REPLICATED_RULES}


class MissingRuleError(KeyError):
    """A logical axis name that no rule maps to mesh axes."""

    def __str__(self):  # KeyError quotes its message otherwise
        return str(self.args[0])


class IndivisibleError(ValueError):
    """A dimension that the product of its mesh axis sizes does not divide."""


def get_rules(rules: "Rules | str | Sequence | Mapping | None") -> Rules:
    """A rule set from a preset name (`"fsdp_tp"`, `"fsdp"`, `"replicated"`), a sequence of
    pairs (a config may hold lists), or a dict (insertion ordered); None → `DEFAULT_RULES`."""
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(f"unknown sharding rules preset {rules!r}; presets: {sorted(PRESETS)}")
        return PRESETS[rules]
    if isinstance(rules, Mapping) or hasattr(rules, "items"):
        rules = list(rules.items())
    out = []
    for pair in rules:
        if len(pair) != 2:
            raise ValueError(f"a sharding rule is a (logical axis, mesh axes) pair, got {pair!r}")
        name, axes = pair
        if isinstance(axes, list):
            axes = tuple(axes)
        out.append((str(name), axes))
    return tuple(out)


def _lookup(rules: Rules, name: str, where: str):
    for rule_name, axes in rules:
        if rule_name == name:
            return axes
    raise MissingRuleError(
        f"{where}: logical axis {name!r} has no sharding rule (rules cover "
        f"{[r for r, _ in rules]}); add e.g. ({name!r}, None) to replicate it or ({name!r}, 'fsdp') "
        "to shard it")


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    where: str = "array",
    on_indivisible: str = "error",
) -> P:
    """The `PartitionSpec` of an array of `shape` whose axes are named `names`.

    `None` names are replicated. Mesh axes of size 1 are dropped from the spec (they split
    nothing). Raises `MissingRuleError` for a name without a rule and `IndivisibleError`
    when a dimension is not divisible by its mesh axes (unless `on_indivisible="replicate"`).
    """
    if on_indivisible not in ("error", "replicate"):
        raise ValueError(f"on_indivisible={on_indivisible!r}; expected 'error' or 'replicate'")
    rules = get_rules(rules)
    if len(names) != len(shape):
        raise ValueError(f"{where}: {len(names)} axis names {tuple(names)} for shape {tuple(shape)}")
    used: dict[str, str] = {}
    spec = []
    for name, dim in zip(names, shape):
        if name is None:
            spec.append(None)
            continue
        axes = _as_tuple(_lookup(rules, name, where))
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(f"{where}: rule {name!r} -> {axes} names mesh axis {a!r}, but the mesh "
                                 f"has axes {tuple(mesh.shape)}")
            if a in used:
                raise ValueError(f"{where}: mesh axis {a!r} would shard both {used[a]!r} and {name!r}; "
                                 "a mesh axis can split only one dimension of an array")
            used[a] = name
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if dim % size:
            msg = (f"{where}: axis {name!r} of size {dim} is not divisible by mesh axes {axes} "
                   f"(= {size} devices)")
            if on_indivisible == "error":
                raise IndivisibleError(msg + "; change the mesh or the rule, or pass "
                                       "on_indivisible='replicate'")
            logger.warning("%s; replicating this dimension", msg)
            axes = ()
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def _path_str(path) -> str:
    return "/".join(_key_str(k) for k in path)


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


# ----------------------------------------------------------------------------- parameters


def _boxed_shapes(model: Transformer, seq_len: int = 2):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32)))["params"]


def _is_box(x) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def param_specs(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                on_indivisible: str = "error") -> PyTree:
    """A pytree like the params of `PartitionSpec`s."""
    rules = get_rules(rules)
    boxed = _boxed_shapes(model)

    def spec(path, box):
        return logical_to_spec(box.names, box.value.shape, mesh, rules, where=f"param {_path_str(path)}",
                               on_indivisible=on_indivisible)

    return jax.tree_util.tree_map_with_path(spec, boxed, is_leaf=_is_box)


def param_shardings(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                    on_indivisible: str = "error") -> PyTree:
    """A pytree like the params of `NamedSharding`s on `mesh`, from the logical axis names.

    Raises:
      MissingRuleError: a parameter axis name without a rule (the message names the param).
      IndivisibleError: a dimension its mesh axes do not divide (the message names the param).
    """
    specs = param_specs(model, mesh, rules, on_indivisible=on_indivisible)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def abstract_params(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                    on_indivisible: str = "error") -> PyTree:
    """`jax.ShapeDtypeStruct`s of the params, each carrying its sharding (no memory used)."""
    shapes = jax.tree.map(lambda b: b.value, _boxed_shapes(model), is_leaf=_is_box)
    shardings = param_shardings(model, mesh, rules, on_indivisible=on_indivisible)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_sharded(model: Transformer, rng: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                 seq_len: int = 8, on_indivisible: str = "error") -> PyTree:
    """`init_params(model, rng)` computed by a jit whose outputs are born sharded.

    No device ever holds the whole model: each computes only its own shards. With
    `jax_threefry_partitionable` (the default) the values equal the unsharded init.
    """
    shardings = param_shardings(model, mesh, rules, on_indivisible=on_indivisible)
    init = jax.jit(lambda r: init_params(model, r, seq_len=seq_len), out_shardings=shardings)
    return init(rng)


# ----------------------------------------------------------------------------- state


def _path_keys(path) -> tuple[str, ...]:
    return tuple(_key_str(k) for k in path)


def _matcher(params_shardings: PyTree, mesh: Mesh | None):
    """`pick(path, leaf) -> sharding` by longest parameter-path suffix (see match_shardings)."""
    flat_params = jax.tree_util.tree_flatten_with_path(params_shardings)[0]
    if not flat_params:
        raise ValueError("params_shardings is empty")
    by_path = {_path_keys(p): s for p, s in flat_params}
    mesh = mesh if mesh is not None else flat_params[0][1].mesh
    repl = NamedSharding(mesh, P())
    max_len = max(len(p) for p in by_path)

    def pick(path, leaf):
        keys = _path_keys(path)
        shape = tuple(np.shape(leaf))
        for k in range(min(len(keys), max_len), 0, -1):
            s = by_path.get(keys[-k:])
            if s is not None and _spec_fits(s.spec, shape, s.mesh):
                return s
        if len(shape) > 0:
            logger.warning("state leaf %s %s matches no parameter; replicating it", _path_str(path), shape)
        return repl

    return pick


def match_shardings(tree_shape: PyTree, params_shardings: PyTree, mesh: Mesh | None = None) -> PyTree:
    """Shardings for any pytree whose array leaves mirror the params (a `TrainState`, optax
    states: `mu`, `nu`, EMA copies, ...).

    A leaf whose path ends with a parameter's full path (and whose shape that parameter's
    spec divides) takes its sharding, the longest such path winning; every other leaf
    (step counters, scalars, schedule state) is replicated. A non-scalar leaf that matches
    no parameter is replicated too, with a warning.
    """
    return jax.tree_util.tree_map_with_path(_matcher(params_shardings, mesh), tree_shape)


def _spec_fits(spec: P, shape, mesh: Mesh) -> bool:
    if len(spec) > len(shape):
        return False
    for axes, dim in zip(spec, shape):
        size = math.prod(mesh.shape[a] for a in _as_tuple(axes))
        if dim % size:
            return False
    return True


def optimizer_state_shardings(tx: optax.GradientTransformation, params_shardings: PyTree,
                              params_shape: PyTree | None = None) -> PyTree:
    """Shardings of `tx.init(params)`: moments take their parameter's sharding, counts are
    replicated. `params_shape`: the params' shapes (arrays or `ShapeDtypeStruct`s); may be
    omitted when `params_shardings` holds `ShapeDtypeStruct`s with shardings
    (`abstract_params`)."""
    leaves = jax.tree.leaves(params_shardings)
    if params_shape is None:
        if not all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise ValueError("pass params_shape, or ShapeDtypeStructs with shardings as params_shardings")
        params_shape, params_shardings = params_shardings, jax.tree.map(lambda x: x.sharding, params_shardings)
    opt_shape = jax.eval_shape(tx.init, params_shape)
    return match_shardings(opt_shape, params_shardings)


def _unwrap(params_shardings):
    if all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in jax.tree.leaves(params_shardings)):
        return jax.tree.map(lambda x: x.sharding, params_shardings)
    return params_shardings


def state_shardings(state_shape: PyTree, params_shardings: PyTree = None, *,
                    roles: Mapping[str, PyTree] | None = None, mesh: Mesh | None = None) -> PyTree:
    """Shardings of a whole train state (params, optimizer state, step) by path matching.

    One model: `state_shardings(state_shape, params_shardings)`. Several roles whose params
    share paths but not shardings (an actor and a critic under different rules): `roles`
    maps the state's top-level field or key to that role's params shardings, e.g.
    `roles={"actor": actor_sh, "critic": critic_sh, "ref_params": actor_sh}`; fields not
    named (counters, controller state) are replicated, and `params_shardings`, if given,
    serves every field that `roles` does not name.
    """
    if roles is None:
        if params_shardings is None:
            raise ValueError("give params_shardings or roles")
        return match_shardings(state_shape, _unwrap(params_shardings), mesh)
    pickers = {k: _matcher(_unwrap(v), mesh) for k, v in roles.items()}
    if mesh is None:
        mesh = jax.tree.leaves(_unwrap(next(iter(roles.values()))))[0].mesh
    default = None if params_shardings is None else _matcher(_unwrap(params_shardings), mesh)
    repl = NamedSharding(mesh, P())

    def pick(path, leaf):
        fn = pickers.get(_key_str(path[0]), default) if path else default
        return repl if fn is None else fn(path, leaf)

    return jax.tree_util.tree_map_with_path(pick, state_shape)


def init_train_state_sharded(model: Transformer, tx: optax.GradientTransformation, rng: jax.Array, mesh: Mesh,
                             rules: Rules = DEFAULT_RULES, *, seq_len: int = 8,
                             on_indivisible: str = "error"):
    """`(TrainState, its shardings)` with params *and* optimizer state born sharded."""
    from jaxrlhf.algorithms.common import TrainState

    p_sh = param_shardings(model, mesh, rules, on_indivisible=on_indivisible)
    make = lambda r: TrainState.create(init_params(model, r, seq_len=seq_len), tx)
    sh = state_shardings(jax.eval_shape(make, rng), p_sh)
    return jax.jit(make, out_shardings=sh)(rng), sh


def place_state(state: PyTree, params_shardings: PyTree = None, *, roles: Mapping[str, PyTree] | None = None):
    """`(state, shardings)`: an existing (e.g. host-built) state moved onto its shardings
    (`state_shardings` with the same arguments)."""
    sh = state_shardings(jax.eval_shape(lambda: state), params_shardings, roles=roles)
    return jax.device_put(state, sh), sh


def abstract_state(state_shape: PyTree, shardings: PyTree) -> PyTree:
    """`ShapeDtypeStruct`s of `state_shape` (arrays or shapes) carrying `shardings`: the
    target a checkpoint restores into (`runs.checkpointing.Checkpointer.restore`), whose
    mesh may differ from the one that saved it."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shape, shardings)


def put_sharded(host_tree: PyTree, shardings: PyTree) -> PyTree:
    """Host arrays (the same values on every process, e.g. from `models.random_init`) →
    global arrays with `shardings`; each process places only its own devices' slices
    (`jax.make_array_from_callback`), so this works across hosts too."""
    def one(x, s):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.make_array_from_callback(x.shape, s, lambda idx: np.asarray(x[idx]))
    return jax.tree.map(one, host_tree, shardings)


# ----------------------------------------------------------------------------- batch, activations


def batch_spec(ndim: int, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, rows: int | None = None,
               where: str = "batch") -> P:
    """Rows over the `batch` rule's mesh axes, every other axis replicated (a scalar: P())."""
    if ndim == 0:
        return P()
    names = ("batch",) + (None,) * (ndim - 1)
    shape = (rows if rows is not None else 0,) + (1,) * (ndim - 1)
    return logical_to_spec(names, shape, mesh, rules, where=where)


def batch_shardings(batch: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """`NamedSharding`s for a batch pytree: leading axis over `(data, fsdp)`.

    Raises `IndivisibleError` when a leaf's row count does not split over the batch axes.
    """
    def one(path, x):
        shape = np.shape(x)
        return NamedSharding(mesh, batch_spec(len(shape), mesh, rules, rows=shape[0] if shape else None,
                                              where=f"batch leaf {_path_str(path) or '<root>'}"))
    return jax.tree_util.tree_map_with_path(one, batch)


def shard_batch(batch: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Place a batch on the mesh, rows split over `(data, fsdp)`.

    Single process: `batch` is the global batch. Several processes (`jax.process_count() >
    1`): each passes its *host-local* rows (its share, see `distributed.host_slice`) and
    gets back global arrays of `process_count ×` as many rows, assembled with
    `jax.make_array_from_process_local_data`; no host ever holds the global batch.
    """
    if jax.process_count() == 1:
        return jax.device_put(batch, batch_shardings(batch, mesh, rules))

    def one(path, x):
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x, ())
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        spec = batch_spec(x.ndim, mesh, rules, rows=global_shape[0], where=f"batch leaf {_path_str(path)}")
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, global_shape)

    return jax.tree_util.tree_map_with_path(one, batch)


def constrain(x: jax.Array, names: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
              on_indivisible: str = "replicate") -> jax.Array:
    """`with_sharding_constraint` of an activation by logical names, e.g.
    `constrain(h, ("batch", "length", "embed"), mesh, rules)`; use inside jit."""
    spec = logical_to_spec(names, x.shape, mesh, rules, where="activation", on_indivisible=on_indivisible)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_batch(batch: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Inside jit: pin every batch leaf to rows over `(data, fsdp)` (when they divide)."""
    def one(x):
        names = ("batch",) + (None,) * (x.ndim - 1) if x.ndim else ()
        return constrain(x, names, mesh, rules) if x.ndim else x
    return jax.tree.map(one, batch)


def cache_shardings(cache: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Shardings of a KV cache (per layer `KVCache(k [B, K, H, S], v [B, K, S, H])`; bare
    4-D leaves are read as `[B, K, S, H]`; a scanned stack's one `KVCache` has 5-D leaves
    with the `layers` axis second, `[B, n, K, ., .]`): batch over the `batch` rule's axes
    and kv heads over the `kv_heads` rule's axes, each only when it divides (otherwise that
    dimension is replicated: e.g. 1 kv head under tensor=2)."""
    def one(path, x):
        if np.ndim(x) not in (4, 5):
            raise ValueError(f"KV cache leaves must be 4-D [B, K, ., .] (or 5-D [B, layers, K, ., .] for a "
                             f"scanned stack), got shape {np.shape(x)}")
        is_key = bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "k"
        names = (("batch", "kv_heads", "head_dim", "cache_length") if is_key
                 else ("batch", "kv_heads", "cache_length", "head_dim"))
        if np.ndim(x) == 5:
            names = names[:1] + ("layers",) + names[1:]
        spec = logical_to_spec(names, np.shape(x), mesh, rules, where="KV cache", on_indivisible="replicate")
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, cache)


# ----------------------------------------------------------------------------- steps


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def jit_step(
    step_fn: Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree]],
    *,
    mesh: Mesh,
    state_shardings: PyTree,
    rules: Rules = DEFAULT_RULES,
    donate: bool = True,
) -> Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree]]:
    """Jit `step_fn(state, batch, rng) -> (state, metrics)` for the mesh.

    in_shardings = (state_shardings, batch rows over `(data, fsdp)`, replicated rng);
    out_shardings = (state_shardings, replicated metrics); `donate_argnames=("state",)`
    so the old state's buffers are reused (do not touch the passed state afterwards).
    The batch is also pinned with a sharding constraint inside the step. One compilation
    per batch structure/shape. In a single process a batch that is not yet on the mesh is
    placed (`shard_batch`); with several processes pass global arrays from `shard_batch`.
    """
    rules = get_rules(rules)
    repl = replicated(mesh)
    compiled: dict = {}

    def inner(state, batch, rng):
        return step_fn(state, constrain_batch(batch, mesh, rules), rng)

    def call(state, batch, rng):
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        if key not in compiled:
            b_sh = batch_shardings(batch, mesh, rules)
            compiled[key] = (b_sh, jax.jit(inner, in_shardings=(state_shardings, b_sh, repl),
                                           out_shardings=(state_shardings, repl),
                                           donate_argnames=("state",) if donate else ()))
        b_sh, fn = compiled[key]
        if jax.process_count() == 1:
            batch = jax.device_put(batch, b_sh)
        return fn(state, batch, rng)

    call.lower = lambda state, batch, rng: (jax.jit(inner, in_shardings=(
        state_shardings, batch_shardings(batch, mesh, rules), repl), out_shardings=(state_shardings, repl))
        .lower(state, batch, rng))
    return call


def kernel_mesh(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """`models.attention.kernel_mesh` for `mesh` under `rules`: the context in which steps
    traced by `jax.jit` run the TPU splash kernel per device, batch rows and kv heads split
    as `rules` split the `batch` and `kv_heads` axes (`with kernel_mesh(mesh, rules): ...`)."""
    rules = get_rules(rules)
    return attention.kernel_mesh(mesh, batch_axes=_as_tuple(_lookup(rules, "batch", "kernel_mesh")),
                                 head_axes=_as_tuple(_lookup(rules, "kv_heads", "kernel_mesh")))


def jit_sharded(fn: Callable, *, in_shardings, out_shardings, donate_argnames: Sequence[str] = ()) -> Callable:
    """`jax.jit` with explicit shardings: for role-specific functions (a reference or reward
    model's scoring pass) whose params use their own rules."""
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnames=tuple(donate_argnames))
