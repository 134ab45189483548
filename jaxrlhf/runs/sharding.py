"""Where a run's arrays live: the device mesh of the config, each role's shardings, and
host batches assembled into global arrays.

`Placement.from_config(config)` builds `parallel.make_mesh(config.mesh)` over all devices
of all processes, with the rule preset `config.rules`. The phases use it to

- place parameters (`place_params`) and build train states born in their shardings
  (`init_state`: `jax.jit(make_state, out_shardings=...)`, each role's fields matched by
  parameter path: policy, reference, critic, reward model);
- read only this process's rows of every batch (`batch_iterator`) and assemble the global
  batch from them (`global_batch`: `jax.make_array_from_process_local_data`);
- jit steps with explicit in/out shardings and a donated state (`jit_step`);
- hand evaluation data that every process holds whole to the mesh (`put_rows`, padded to
  the batch shards with `padded_rows`) and get results back replicated, so that every
  process reads the same numbers (`replicated`, `fetch`).

A single process with a single device is the trivial mesh: every sharding is that device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrlhf import data
from jaxrlhf.parallel import distributed
from jaxrlhf.parallel.mesh import make_mesh
from jaxrlhf.parallel.rules import (Rules, batch_spec, get_rules, jit_step, kernel_mesh, param_shardings,
                                    state_shardings)

log = logging.getLogger("jaxrlhf")

PyTree = Any
DEFAULT_MESH = "data=-1"
DEFAULT_RULES_NAME = "fsdp_tp"


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """A mesh and a rule set, with the helpers that put a run's arrays on them."""

    mesh: Mesh
    rules: Rules
    rules_name: str = DEFAULT_RULES_NAME
    mesh_spec: str = DEFAULT_MESH
    _param_shardings: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config) -> "Placement":
        """From the top-level `mesh` and `rules` of a run config (defaults when absent)."""
        spec = config.get("mesh", None) or DEFAULT_MESH
        rules = config.get("rules", None) or DEFAULT_RULES_NAME
        try:
            mesh = make_mesh(spec)
        except ValueError as e:
            raise ValueError(f"config.mesh={spec!r}: {e} (this job has {jax.device_count()} devices over "
                             f"{jax.process_count()} process(es))") from None
        try:
            rule_set = get_rules(rules)
        except ValueError as e:
            raise ValueError(f"config.rules={rules!r}: {e}") from None
        return cls(mesh, rule_set, str(rules), str(spec))

    @classmethod
    def local(cls) -> "Placement":
        """One device of this process (what code without a run config gets)."""
        return cls(make_mesh("data=1", devices=jax.local_devices()[:1]), get_rules(DEFAULT_RULES_NAME))

    # ------------------------------------------------------------------ facts

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_ways(self) -> int:
        """Into how many row blocks a batch is split (the `batch` rule's mesh axes)."""
        spec = batch_spec(1, self.mesh, self.rules, rows=0)
        return math.prod(self.mesh.shape[a] for a in _axes(spec[0]))

    def describe(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return (f"mesh ({shape}) over {self.mesh.size} device(s) of {jax.process_count()} process(es), "
                f"rules {self.rules_name!r}: batch rows split {self.batch_ways} ways")

    def kernels(self):
        """The context in which the run's steps compile: accelerator kernels that GSPMD does
        not partition (TPU splash attention) run per device of this mesh (`parallel.kernel_mesh`)."""
        return kernel_mesh(self.mesh, self.rules)

    # ------------------------------------------------------------------ parameters and state

    def param_shardings(self, model) -> PyTree:
        """The model's parameter shardings under the rules; a dimension that its mesh axes
        do not divide (e.g. an odd vocabulary under tensor=2) is replicated, with a warning
        (once per model)."""
        try:
            return self._param_shardings[model]
        except TypeError:  # an unhashable model: no cache
            return param_shardings(model, self.mesh, self.rules, on_indivisible="replicate")
        except KeyError:
            sh = self._param_shardings[model] = param_shardings(model, self.mesh, self.rules,
                                                                on_indivisible="replicate")
            return sh

    def stacked(self, shardings: PyTree) -> PyTree:
        """The shardings of K stacked copies (leaves `[K, ...]`, e.g. a reward-model
        ensemble): each leaf's sharding with the leading member axis replicated."""
        return jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), shardings)

    def place(self, tree: PyTree, shardings: PyTree) -> PyTree:
        """Arrays (global ones, or host / single-device values that are the same on every
        process) moved onto `shardings`; leaves already there are kept as they are."""
        single = jax.process_count() == 1

        def one(x, s):
            if isinstance(x, jax.Array):
                if x.sharding == s:
                    return x
                if single or not x.is_fully_addressable:
                    return jax.device_put(x, s)
            elif single:
                return jax.device_put(x, s)
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

        return jax.tree.map(one, tree, shardings)

    def place_params(self, model, params: PyTree) -> PyTree:
        return self.place(params, self.param_shardings(model))

    def init_state(self, make: Callable, *args, params_shardings: PyTree = None,
                   roles: Mapping[str, PyTree] | None = None) -> tuple[Any, PyTree]:
        """`(state, shardings)`: `make(*args)` computed by a jit whose outputs are born in
        the shardings that `parallel.state_shardings` gives (parameters, their optimizer
        moments and reference copies by path, per role; counters replicated). The args
        must already be placed (`place_params`); they are donated (the state takes over
        their buffers, as a train step would), so do not use them afterwards."""
        shape = jax.eval_shape(make, *args)
        sh = state_shardings(shape, params_shardings, roles=roles, mesh=self.mesh)
        return jax.jit(make, out_shardings=sh, donate_argnums=tuple(range(len(args))))(*args), sh

    def jit_step(self, step_fn: Callable, state_shardings: PyTree) -> Callable:
        """`parallel.jit_step`: explicit in/out shardings, the state donated."""
        return jit_step(step_fn, mesh=self.mesh, state_shardings=state_shardings, rules=self.rules)

    # ------------------------------------------------------------------ batches

    def rows(self, ndim: int, rows: int, where: str = "batch") -> NamedSharding:
        """The sharding of a `[rows, ...]` array: rows over the `batch` rule's axes."""
        return NamedSharding(self.mesh, batch_spec(ndim, self.mesh, self.rules, rows=rows, where=where))

    def check_rows(self, rows: int, field: str) -> None:
        """A clear error when `field` (a config field holding a global row count) does not
        split over the batch shards."""
        if rows % self.batch_ways:
            shape = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
            raise ValueError(
                f"{field}={rows} does not split into the {self.batch_ways} row shards of mesh ({shape}) under rules "
                f"{self.rules_name!r}; make it a multiple of {self.batch_ways} or change config.mesh")

    def process_rows(self, rows: int) -> tuple[int, int]:
        """`(index, count)`: of a global batch of `rows` cut into `count` equal contiguous
        blocks, this process holds block `index` (count 1: every process holds them all,
        e.g. when only `tensor` spans the processes)."""
        if jax.process_count() == 1:
            return 0, 1
        sh = self.rows(1, rows)
        ranges = sorted({idx[0].indices(rows)[:2] for idx in sh.addressable_devices_indices_map((rows,)).values()})
        lo, hi = ranges[0][0], ranges[-1][1]
        contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        size = hi - lo
        if not contiguous or rows % size or lo % size:
            raise ValueError(f"the batch rows of process {jax.process_index()} under the {self.describe()} are not "
                             f"one block of a split of {rows} rows (they are {ranges}); order the mesh devices by "
                             "process")
        return lo // size, rows // size

    def batch_iterator(self, num_examples: int, rows: int, *, seed: int, field: str) -> data.BatchIterator:
        """A `data.BatchIterator` over this process's share of each global batch of `rows`
        (the config field `field`): the global batches are those of a single process."""
        self.check_rows(rows, field)
        index, count = self.process_rows(rows)
        return data.BatchIterator(num_examples, rows // count, seed=seed, process_index=index, process_count=count)

    def global_batch(self, local: Mapping[str, Any], rows: int) -> dict:
        """Global arrays of `rows` rows from this process's rows (`batch_iterator`).
        Object arrays (e.g. answer strings for host rewards) stay on the host."""
        single = jax.process_count() == 1

        def one(k, x):
            x = np.asarray(x)
            if x.dtype == object:
                return x
            sh = self.rows(x.ndim, rows, where=f"batch leaf {k}")
            if single:
                return jax.device_put(x, sh)
            return jax.make_array_from_process_local_data(sh, x, (rows,) + x.shape[1:])

        return {k: one(k, v) for k, v in local.items()}

    def padded_rows(self, rows: int) -> int:
        """`rows` rounded up to a multiple of the batch shards."""
        return -(-rows // self.batch_ways) * self.batch_ways

    def put_rows(self, batch: Mapping[str, Any]) -> dict:
        """Host arrays that every process holds whole (evaluation data) → global arrays
        with rows over the batch shards; each process places its own devices' rows."""
        single = jax.process_count() == 1

        def one(k, x):
            x = np.asarray(x)
            sh = self.rows(x.ndim, x.shape[0], where=k)
            if single:
                return jax.device_put(x, sh)
            return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

        return {k: one(k, v) for k, v in batch.items()}

    def local_rows(self, x: jax.Array) -> np.ndarray:
        """This process's rows of a row-sharded global array, in order (every row in a
        single process): what a host-side reward scores on this process."""
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        blocks = {}
        for shard in x.addressable_shards:
            start = shard.index[0].indices(x.shape[0])[0]
            blocks.setdefault(start, shard.data)
        return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])

    # ------------------------------------------------------------------ reading back

    def fetch(self, tree: PyTree) -> PyTree:
        """Host numpy copies, identical on every process (all processes must call it)."""
        return distributed.gather(tree)


def pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict:
    """Every array of `batch` extended to `rows` rows by repeating its last row."""
    def one(x):
        x = np.asarray(x)
        n = x.shape[0]
        return x if n == rows else np.concatenate([x, np.repeat(x[-1:], rows - n, axis=0)])
    return {k: one(v) for k, v in batch.items()}


__all__ = ["Placement", "pad_rows"]
