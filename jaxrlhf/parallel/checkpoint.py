"""Sharded train-state checkpoints (Orbax) that restore into any mesh.

Every process calls `save` with the same global state; each writes only the shards it
owns (to a shared filesystem or GCS bucket), and process 0 finalises the directory.
`restore` takes a *target*: shapes/dtypes with the shardings of the mesh you restore
into, which may differ from the one that saved (another device count or rule set) —
Orbax reads each target shard's slice from the saved tensors.

    target = abstract_state(state_shape, new_state_shardings)
    state = restore(path, target)
"""

from __future__ import annotations

import os
from typing import Any

import jax

PyTree = Any


def _path(path) -> str:
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)  # gs://, s3:// stay as they are


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def save(path: str | os.PathLike, state: PyTree, *, overwrite: bool = False) -> str:
    """Write `state` (a pytree of global arrays) to `path`; blocks until it is complete.

    All processes must call it. An existing `path` is an error unless `overwrite=True`.
    """
    path = _path(path)
    ckpt = _checkpointer()
    ckpt.save(path, state, force=overwrite)
    ckpt.wait_until_finished()
    ckpt.close()
    return path


def abstract_state(state_shape: PyTree, shardings: PyTree) -> PyTree:
    """`ShapeDtypeStruct`s of `state_shape` (arrays or shapes) carrying `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shape, shardings)


def restore(path: str | os.PathLike, target: PyTree) -> PyTree:
    """Read a checkpoint written by `save` into the shardings of `target` (a pytree of
    `ShapeDtypeStruct`s with shardings, see `abstract_state`). All processes call it."""
    path = _path(path)
    ckpt = _checkpointer()
    try:
        return ckpt.restore(path, target)
    finally:
        ckpt.close()
