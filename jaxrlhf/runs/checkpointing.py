"""Orbax checkpoints of a run: the train-state pytree plus a small JSON of loop metadata.

Saves are asynchronous, keep the last N, and are atomic: orbax writes into a temporary
folder and renames it when complete, so a crash never leaves a checkpoint that looks
finished; the temporary folder of a save that never finished is removed when the next run
opens the phase's checkpoints. `close(timeout=...)` waits a bounded time for a save in
flight (a Ctrl-C's way out), and a full disk is an OSError naming the phase's folder. A
checkpoint folder that exists but cannot be read is reported with its path rather than
silently skipped. A checkpoint may hold a third item, `best`: the parameters
of the best evaluation so far when a phase keeps them (`train.keep_best`, `runs.stopping`).

`restore_newest` is what a resuming run calls: when the newest step does not restore (a
file truncated or damaged after it was written) it falls back to the newest older step
that does, with a warning, and moves the bad step's folder aside (`<step>.corrupt-<n>`,
never deleted; orbax ignores a folder whose name is not a step) so the run can write that
step again. When no step restores, nothing is moved and the error names the folder.

A step that lacks a file every restore needs (a deleted `manifest.ocdbt`, an interrupted
copy) is reported as incomplete, naming the file, before orbax is asked to read it
(`Checkpointer.incomplete`); the reads that a failed orbax restore leaves in flight report
only to the debug log (`_quiet_orphaned_reads`), so the user sees the one warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from jaxrlhf import exits
from jaxrlhf.models.hf_checkpoint import CheckpointError
from jaxrlhf.parallel import distributed

log = logging.getLogger("jaxrlhf")


def _brief(error: BaseException, limit: int = 400) -> str:
    """One line for an orbax/TensorStore error: its innermost cause (the file or tensor that
    failed to read, not a page of TensorStore spec), first line, at most `limit` characters."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_orphaned_read(unraisable) -> bool:
    """An unraisable error of the reads a failed orbax restore left in flight: TensorStore
    completing a read for an event loop orbax has closed, or an orbax read coroutine whose
    error nobody awaited any more."""
    code = getattr(unraisable.object, "cr_code", None)
    return (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
            ) or (code is not None and "orbax" in code.co_filename)


class _OrphanedTasks(logging.Filter):
    """asyncio's "Task exception was never retrieved" for an orbax read or TensorStore open
    of a failed restore (its error already reported once) goes to the debug log."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("Task exception was never retrieved") and ("orbax" in text or "tensorstore" in text):
            log.debug("after a failed checkpoint restore: %s", text.splitlines()[-1][:400])
            return False
        return True


def _quiet_orphaned_reads() -> None:
    """Routes the orphaned reads of a failed restore (`_is_orphaned_read`, `_OrphanedTasks`)
    to the debug log.

    Orbax gives up on a restore (or a metadata read) at its first unreadable array while
    TensorStore's other reads are still running; each reports through `sys.unraisablehook`
    or asyncio's logger, hundreds of tracebacks printed around the one line that explains
    the failure (even at interpreter exit). Installed once, before the first restore, as
    such reports can come before the failure reaches the caller; every other report goes to
    the hook and the logger as before.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_jaxrlhf_orphaned_reads", False):
        return

    def hook(unraisable):
        if _is_orphaned_read(unraisable):
            log.debug("after a failed checkpoint restore: %s", unraisable.exc_value)
        else:
            previous(unraisable)

    hook._jaxrlhf_orphaned_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_OrphanedTasks())


class Checkpointer:
    """`save(step, state, meta)` / `restore(abstract_state) -> (step, state, meta)`.

    `meta` is JSON: data-iterator position, KL-controller scalars, phase,
    early-stopping state. `save(..., best=params)` adds the optional `best` pytree, read
    back with `restore_best`.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._closing = False
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=dict(
            state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler(),
            best=ocp.StandardCheckpointHandler()))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict, *, best: Any = None, force: bool = False) -> None:
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if best is not None:
            items["best"] = ocp.args.StandardSave(best)
        with self._writing():  # an earlier save's failure surfaces here too
            self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def wait(self) -> None:
        with self._writing():
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _writing(self):
        """A full disk while a checkpoint is written is an OSError naming the phase's folder
        (orbax's own errors do not say which)."""
        try:
            yield
        except Exception as e:
            if exits.full_disk(e) is not None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory)) from e
            raise

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """Restore `step` (default: latest) into the structure/shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        missing = self.incomplete(step, ("state", "meta"))
        if missing is not None:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} is incomplete: {missing}")
        _quiet_orphaned_reads()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        mismatch = self._shape_mismatch(step, target)
        if mismatch is not None:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} does not match the current "
                                  f"model/optimizer: {mismatch}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is corrupt, partial, or does not match the "
                f"current model/optimizer: {_brief(e)}") from e
        log.info("restored checkpoint %s", self.directory / str(step))
        return step, restored["state"], dict(restored["meta"])

    def incomplete(self, step: int, items: tuple[str, ...]) -> str | None:
        """Which file of checkpoint `step` that a restore of `items` needs is missing, found
        without orbax: a pytree item's `_METADATA` (its tree) and, when that says OCDBT,
        `manifest.ocdbt` (the index of its arrays); the JSON item `meta`'s `metadata`.
        None when they are all there (a damaged file is left to the restore to report)."""
        folder = self.directory / str(step)
        for item in items:
            if item == "meta":
                if not (folder / item / "metadata").is_file():
                    return f"{item}/metadata is missing"
                continue
            tree = folder / item / "_METADATA"
            try:
                use_ocdbt = json.loads(tree.read_text()).get("use_ocdbt", False)
            except FileNotFoundError:
                return f"{item}/_METADATA is missing"
            except (OSError, ValueError, AttributeError):  # there but damaged: the restore's error says how
                continue
            if use_ocdbt and not (folder / item / "manifest.ocdbt").is_file():
                return f"{item}/manifest.ocdbt is missing"
        return None

    def _shape_mismatch(self, step: int, target: Any) -> str | None:
        """The first tensor whose saved shape differs from `target`'s (from the checkpoint's
        metadata, before any read: orbax's own error is a page of TensorStore spec, and its
        advice, `strict=False`, is wrong here), or None. Unreadable metadata is left to
        `restore` to report."""
        try:
            saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(self._manager.item_metadata(step)["state"])}
        except Exception:  # noqa: BLE001 - reported by the restore that follows
            return None
        for path, leaf in jax.tree_util.tree_leaves_with_path(target):
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            if name in saved and saved[name] != tuple(leaf.shape):
                return f"{name} is {saved[name]} in the checkpoint and {tuple(leaf.shape)} now"
        return None

    def restore_newest(self, abstract_state: Any, *, check: Callable[[Any], str | None] | None = None
                       ) -> tuple[int, Any, dict]:
        """Restore the newest step that restores and passes `check(state)` (None = fit, else
        why not), into the structure/shardings of `abstract_state`.

        Steps newer than the one restored are moved aside (`move_aside`) with a warning naming
        each and its error. Every process takes the same decision: a step counts as failed
        when it failed to read on any process, and `check` must give every process the same
        answer (e.g. from a replicated reduction). When no step restores, nothing is moved and the
        `CheckpointError` names the folder, the newest step's error and what to do.
        """
        failed: list[tuple[int, str]] = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                restored, problem = self.restore(abstract_state, step), None
            except CheckpointError as e:
                restored, problem = None, str(e)
            if distributed.any_process(problem is not None):
                failed.append((step, problem or "it does not restore on another process"))
                continue
            if check is not None and (problem := check(restored[1])) is not None:  # the same on every process
                failed.append((step, problem))
                continue
            for bad, error in failed:
                log.warning("checkpoint %s does not restore (%s); moved to %s, resuming from step %d",
                            self.directory / str(bad), error, self.move_aside(bad).name, step)
            return restored
        if not failed:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        newest, error = failed[0]
        raise CheckpointError(
            f"no checkpoint in {self.directory} restores (steps {', '.join(str(s) for s, _ in failed)}): if the "
            f"config changed since they were written, rerun with the config of config.json; if they are damaged, "
            f"move {self.directory} aside to start this phase over. The newest, {newest}: {error}")

    def move_aside(self, step: int) -> Path:
        """Renames checkpoint `step`'s folder to `<step>.corrupt-<n>` (the first free n), kept
        for inspection, and re-reads the list of steps so that `step` can be written again."""
        distributed.barrier(f"jaxrlhf_move_aside_{self.directory}_{step}_start")
        source = self.directory / str(step)
        n = 1
        while (self.directory / f"{step}.corrupt-{n}").exists():
            n += 1
        target = self.directory / f"{step}.corrupt-{n}"
        if jax.process_index() == 0:
            source.rename(target)
        distributed.barrier(f"jaxrlhf_move_aside_{self.directory}_{step}_done")
        self._manager.reload()
        return target

    def restore_best(self, abstract_best: Any, step: int) -> Any:
        """The `best` item of checkpoint `step`, into the structure/shardings of `abstract_best`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_best)
        missing = self.incomplete(step, ("best",))
        if missing is not None:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has no readable best parameters: {missing}")
        _quiet_orphaned_reads()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(best=ocp.args.StandardRestore(target)))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has no readable best parameters "
                                  f"matching the current model: {_brief(e)}") from e
        return restored["best"]

    def close(self, *, timeout: float | None = None) -> bool:
        """Wait for the save in flight, then close; a second call does nothing. With
        `timeout`, waits at most that many seconds (in a daemon thread, which never holds
        the process up) and returns False when the save is still running."""
        if self._closing:
            return True
        self._closing = True
        if timeout is None:
            self.wait()
            self._manager.close()
            return True
        waiter = threading.Thread(target=self._close_quietly, name="jaxrlhf-checkpoint-close", daemon=True)
        waiter.start()
        waiter.join(timeout)
        return not waiter.is_alive()

    def _close_quietly(self) -> None:
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        except Exception as e:  # noqa: BLE001 - on the way out of an interrupted run: said, not raised
            log.warning("checkpoints in %s: the save in flight failed: %s", self.directory, _brief(e))
