"""Orbax checkpoints of a run: the train-state pytree plus a small JSON of loop metadata.

Saves are asynchronous, keep the last N, and are atomic: orbax writes into a temporary
folder and renames it when complete, so a crash never leaves a checkpoint that looks
finished. A checkpoint folder that exists but cannot be read is reported with its path
rather than silently skipped. A checkpoint may hold a third item, `best`: the parameters
of the best evaluation so far when a phase keeps them (`train.keep_best`, `runs.stopping`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint exists but is corrupt, partial, or does not fit the current state."""


class Checkpointer:
    """`save(step, state, meta)` / `restore(abstract_state) -> (step, state, meta)`.

    `meta` is JSON: data-iterator position, KL-controller scalars, phase, config hash,
    early-stopping state. `save(..., best=params)` adds the optional `best` pytree, read
    back with `restore_best`.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta", "best"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, best: Any = None, force: bool = False) -> None:
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if best is not None:
            items["best"] = ocp.args.StandardSave(best)
        self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """Restore `step` (default: latest) into the structure/shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is corrupt, partial, or does not match the "
                f"current model/optimizer: {type(e).__name__}: {e}") from e
        logging.info("restored checkpoint %s", self.directory / str(step))
        return step, restored["state"], dict(restored["meta"])

    def restore_best(self, abstract_best: Any, step: int) -> Any:
        """The `best` item of checkpoint `step`, into the structure/shardings of `abstract_best`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_best)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(best=ocp.args.StandardRestore(target)))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has no readable best parameters "
                                  f"matching the current model: {type(e).__name__}: {e}") from e
        return restored["best"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
