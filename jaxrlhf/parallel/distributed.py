"""Multi-process (multi-host) runs: start-up, each host's share of the data, metrics once.

Every host runs the same program. `initialize()` joins them (`jax.distributed.initialize`)
from, in order of precedence:

1. explicit arguments (`coordinator_address`, `num_processes`, `process_id`);
2. the environment variables `JAXRLHF_COORDINATOR_ADDRESS`, `JAXRLHF_NUM_PROCESSES`,
   `JAXRLHF_PROCESS_ID` (what `launch/local_multiprocess.sh` sets);
3. cluster auto-detection by JAX (TPU pod workers, SLURM, Open MPI, Kubernetes) when the
   environment shows a multi-process job: `SLURM_NTASKS > 1`, `OMPI_COMM_WORLD_SIZE > 1`,
   several `TPU_WORKER_HOSTNAMES`, or `JAXRLHF_DISTRIBUTED=auto` (set by
   `launch/tpu_pod.sh`, since a TPU VM worker's environment does not show it).

Otherwise it is a no-op (one process). Calling it twice is harmless. On CPU (no
accelerator) collectives between processes go through gloo.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

import jax
import numpy as np

logger = logging.getLogger(__name__)

PyTree = Any
_ENV = "JAXRLHF_"


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _cluster_detected() -> bool:
    if os.environ.get(_ENV + "DISTRIBUTED", "").lower() in ("1", "true", "auto"):
        return True
    if (_env_int("SLURM_NTASKS") or 1) > 1 and os.environ.get("SLURM_JOB_ID"):
        return True
    if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def is_initialized() -> bool:
    try:
        return bool(jax.distributed.is_initialized())
    except AttributeError:  # older jax
        from jax._src import distributed as _d
        return _d.global_state.client is not None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | list[int] | None = None,
    *,
    initialization_timeout: int = 300,
) -> bool:
    """Join the other processes of this job; returns True when running multi-process.

    Must run before anything touches a device (`jax.devices()`, creating arrays). With
    `num_processes=1` (or nothing set and no cluster detected) nothing happens.
    """
    if is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(_ENV + "COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int(_ENV + "NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int(_ENV + "PROCESS_ID")
    if local_device_ids is None and os.environ.get(_ENV + "LOCAL_DEVICE_IDS"):
        local_device_ids = [int(x) for x in os.environ[_ENV + "LOCAL_DEVICE_IDS"].split(",")]
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None
    if num_processes == 1:
        return False
    if explicit:
        missing = [n for n, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                                  ("process_id", process_id)) if v is None]
        if missing:
            raise ValueError(f"distributed.initialize: {missing} not given (arguments or {_ENV}* env); "
                             "give all three, or none to auto-detect the cluster")
    elif not _cluster_detected():
        return False
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                  local_device_ids=local_device_ids, initialization_timeout=initialization_timeout)
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})
    logger.info("process %d of %d, %d local / %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


def shutdown() -> None:
    if is_initialized():
        jax.distributed.shutdown()


def is_main_process() -> bool:
    """True on process 0: the one that logs, writes metrics and HF exports."""
    return jax.process_index() == 0


def host_slice(global_rows: int, mesh=None, rules=None) -> slice:
    """This process's contiguous share of `global_rows` batch rows: feed exactly these rows
    to `shard_batch`.

    With a `mesh`, the rows are those that the batch sharding (`rules`' `batch` axes)
    places on this process's devices; without one, process `i` of `p` gets rows
    `i·n/p .. (i+1)·n/p`.
    """
    p, i = jax.process_count(), jax.process_index()
    if global_rows % p:
        raise ValueError(f"global batch of {global_rows} rows does not split over {p} processes")
    n = global_rows // p
    if mesh is None or p == 1:
        return slice(i * n, (i + 1) * n)
    from jax.sharding import NamedSharding

    from jaxrlhf.parallel.rules import DEFAULT_RULES, batch_spec
    sharding = NamedSharding(mesh, batch_spec(1, mesh, rules or DEFAULT_RULES, rows=global_rows))
    ranges = [idx[0].indices(global_rows)[:2] for idx in
              sharding.addressable_devices_indices_map((global_rows,)).values()]
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    if hi - lo != n:
        raise ValueError(f"the rows of process {i} under mesh {dict(mesh.shape)} are not one contiguous "
                         f"block of {n} (they span {lo}..{hi}); order the mesh devices by process")
    return slice(lo, hi)


def host_local_batch(global_batch: PyTree, mesh=None, rules=None) -> PyTree:
    """This process's rows (`host_slice`) of a batch that every process can index (e.g. a
    dataset read with the same seed everywhere)."""
    leaves = jax.tree.leaves(global_batch)
    rows = np.shape(leaves[0])[0]
    sl = host_slice(rows, mesh, rules)
    return jax.tree.map(lambda x: x[sl] if np.ndim(x) else x, global_batch)


def host_local_to_global(local_batch: PyTree, mesh, rules=None) -> PyTree:
    """Global arrays from each host's local rows (`jax.make_array_from_process_local_data`)."""
    from jaxrlhf.parallel.rules import DEFAULT_RULES, shard_batch
    return shard_batch(local_batch, mesh, rules or DEFAULT_RULES)


def gather(tree: PyTree) -> PyTree:
    """Host numpy copies of (possibly sharded) global arrays, identical on every process.

    Fully replicated arrays (metrics out of a step) are read locally; sharded ones are
    all-gathered across processes (`multihost_utils.process_allgather`).
    """
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def any_process(flag: bool) -> bool:
    """`flag` of any process, the same answer on every process (a preemption signal, or a
    checkpoint file that fails to read, may reach only some of them)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.max(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def barrier(name: str) -> None:
    """Waits until every process got here (a no-op for one process): e.g. after process 0
    renamed a folder the others are about to list."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def gather_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Scalar metrics as Python floats (every process gets the same values)."""
    return {k: float(np.asarray(v)) for k, v in gather(dict(metrics)).items()}


def write_metrics(path: str | os.PathLike, step: int, metrics: Mapping[str, Any]) -> None:
    """Append one JSON line `{"step": .., **metrics}` — from process 0 only.

    Every process must call it (the gather may be collective); only process 0 writes.
    """
    values = gather_metrics(metrics)
    if not is_main_process():
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": int(step), **values}) + "\n")


def sync(name: str = "jaxrlhf") -> None:
    """A barrier across processes (no-op for one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
