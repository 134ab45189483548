"""A run's claim on its workdir: a lock, then the check that the config still fits it.

`claim(workdir, config)` is entered by `experiment.train_and_evaluate` before anything is
written to the workdir, and held for the whole run:

1. **The lock** `workdir/run.lock`, created atomically (`O_CREAT | O_EXCL`) and holding the
   owner's pid, host and start time. A second run on the workdir is refused with the
   holder's pid and host. A lock whose process is gone (dead pid on this host, or the pid
   reused by another process) is stale: it is taken over with a warning. A lock from
   another host cannot be checked: it is refused, saying which file to delete if no run
   is using the workdir. The lock is released on exit, exception or SIGTERM; after kill -9
   it is stale. In a multi-process job process 0 takes it and checks the config, and
   every process learns the outcome (one broadcast), so none runs alone or waits forever;
   a single process needs no collective.
2. **The config record** `workdir/run.json`, written at the first start beside
   `config.json` (the full text): the `identity` — every resolved config key that decides
   what the checkpoints mean (algorithm, the phases that run and their settings, model,
   tokenizer, task and data, seed), with its sha256 `hash` — and the `settings` that may
   change on resume (options marked `safe`, `runs.sections`, and each phase's `steps`). A later start with another
   config (an override, or a config file that changed on disk: the resolved values count)
   is refused with the changed keys (`grpo.optim.lr: 0.001 -> 0.5`) unless every change is
   safe and the user opted in (`resume_with_changes`, the `--resume_with_changes` flag);
   the record is then updated and the changes logged. Unsafe changes are always refused,
   with the advice to use a new `--workdir`. A refused start changes nothing in the
   workdir. The sections of phases that do not run (e.g. `sft.optim` when `sft.steps=0`)
   are not part of the record. A workdir with a record but no results yet (no checkpoint,
   metrics, summary or export: a run that failed at start-up) takes the new config; one
   from an earlier version (results but no record) is accepted with a warning, then
   recorded.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple

import jax
import numpy as np

from jaxrlhf.runs import registry
from jaxrlhf.runs.sections import is_safe
from jaxrlhf.runs.registry import plan

log = logging.getLogger("jaxrlhf")

LOCK_FILE = "run.lock"
RECORD_FILE = "run.json"

# Which keys may change when a workdir resumes (with `--resume_with_changes`) is declared
# on each option's field (`safe`, `runs.sections`): how a run is watched, evaluated,
# checkpointed and placed on devices, not what its checkpoints hold. Besides them, a phase's
# `steps` may grow, or shrink to no fewer than the steps it has run, as long as no later
# phase has started (`_steps_change`); a phase whose learning-rate schedule spans its steps
# (`decay_steps=None`) follows the new length from there on. Every other key is unsafe.

RECORD_FORMAT = 2
# The options renamed since record format 1 (CHANGELOG.md), old -> new. A workdir recorded
# in format 1 is refused: its keys, and its 0 / "" "off" values (now None), mean another
# config than the same run's today.
RENAMED = {"ppo.clip": "ppo.clip_low", "ppo.ent_coef": "ppo.entropy_coef", "ppo.kl_coef": "ppo.beta"}


class WorkdirError(ValueError):
    """The workdir cannot be used by this run: locked by another one, or its config differs."""


class Change(NamedTuple):
    """One changed config key: its old and new value, and whether resuming with it is safe."""
    key: str
    old: object
    new: object
    safe: bool
    why: str = ""

    def __str__(self) -> str:
        why = f" ({self.why})" if self.why else ""
        return f"{self.key}: {self.old} -> {self.new}{why}"


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _digest(identity: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def record_of(config) -> dict:
    """The record of `config` (what `run.json` holds): `identity` (the keys that decide what
    the checkpoints mean, and `phases`), its `hash`, and the `settings` that may change."""
    phases = plan(config)
    flat = _flat(json.loads(json.dumps(config.to_dict(), default=str)))  # JSON values, as read back
    identity, settings = {"phases": list(phases)}, {}
    for key, value in flat.items():
        section = key.split(".")[0]
        if key == f"{section}.steps" and section in registry.PHASES:
            settings[key] = value  # kept for a phase that does not run: 0 -> 4 adds it
        elif section in registry.PHASES and section not in phases:
            continue  # a phase that does not run: its settings mean nothing here
        elif is_safe(config, key):
            settings[key] = value
        else:
            identity[key] = value
    return {"format": RECORD_FORMAT, "hash": _digest(identity), "identity": identity, "settings": settings}


def phase_progress(workdir: Path, phase: str) -> int:
    """The newest finished checkpoint step of `phase` in `workdir` (0: none). Reads folder
    names only: orbax names a finished step `<step>`, one in progress `<step>.orbax-...`."""
    folder = Path(workdir) / phase
    if not folder.is_dir():
        return 0
    return max((int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()), default=0)


def _has_results(workdir: Path) -> bool:
    metrics = workdir / "metrics.jsonl"
    return (any(phase_progress(workdir, p) for p in registry.PHASES) or (workdir / "summary.json").exists()
            or (workdir / "export").exists() or (metrics.exists() and metrics.stat().st_size > 0))


def _steps_change(key: str, old: int, new: int, phases: tuple, progress: dict) -> Change:
    """A change of `<phase>.steps` of a phase that runs before and after it (the steps of
    one that runs on neither side change nothing)."""
    phase = key.split(".")[0]
    later = [p for p in phases[phases.index(phase) + 1:] if progress[p]]
    if later:
        return Change(key, old, new, False, f"{later[0]} already started from the end of {phase}")
    if new < progress[phase]:
        return Change(key, old, new, False, f"{phase} has already run {progress[phase]} steps")
    return Change(key, old, new, True)


def config_changes(old: dict, new: dict, progress: dict) -> list[Change]:
    """The keys that differ between records `old` and `new` (`record_of`), each judged safe
    or not; `progress` is `{phase: steps run}` (`phase_progress`). A phase added or removed
    is one change, its `steps` (or the phase itself), not one per key of its section."""
    old_keys, new_keys = {**old["identity"], **old["settings"]}, {**new["identity"], **new["settings"]}
    old_phases, new_phases = tuple(old["identity"]["phases"]), tuple(new["identity"]["phases"])
    moved = set(old_phases) ^ set(new_phases)  # phases added or removed
    phase_changes = []
    order = list(registry.PHASES)
    for phase in sorted(moved, key=lambda p: order.index(p) if p in order else len(order)):
        key = f"{phase}.steps"
        what = "adds" if phase in new_phases else "removes"
        if key in old_keys and key in new_keys:
            phase_changes.append(Change(key, old_keys[key], new_keys[key], False, f"{what} the {phase} phase"))
        else:
            phase_changes.append(Change(phase, "runs" if phase in old_phases else "does not run",
                                  "runs" if phase in new_phases else "does not run", False))
    missing = "(not set)"
    changes = []
    for key in [*old_keys, *(k for k in new_keys if k not in old_keys)]:
        a, b = old_keys.get(key, missing), new_keys.get(key, missing)
        section = key.split(".")[0]
        if a == b or key == "phases" or section in moved:
            continue
        a, b = (repr(v) if v is not missing else v for v in (a, b))
        if key in new["settings"] and key in old["settings"]:
            if key == f"{section}.steps" and section in new_phases:
                changes.append(_steps_change(key, old_keys[key], new_keys[key], new_phases, progress))
            else:
                changes.append(Change(key, a, b, True))
        elif key not in old_keys:
            # An option newer than the workdir's record (a later version of jaxrlhf): resuming
            # takes its value, listed, if the user opts in (an upgrade strands no workdir).
            changes.append(Change(key, a, b, True, "an option added since this workdir was started"))
        else:
            changes.append(Change(key, a, b, False))
    first = int(bool(changes) and changes[0].key == "algorithm")  # the algorithm, then the phases it runs
    return changes[:first] + phase_changes + changes[first:]


def _write_json(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        if record.get("format") not in range(1, RECORD_FORMAT + 1) or not {"hash", "identity", "settings"} <= set(record):
            raise ValueError(f"format {record.get('format')!r}, expected 1 to {RECORD_FORMAT} with hash, identity and "
                             "settings")
        return record
    except (OSError, ValueError) as e:
        raise WorkdirError(f"{path} is unreadable ({type(e).__name__}: {e}): restore it, or delete it to let "
                           "this run's config become the workdir's") from None


def record_config(workdir: Path, config, *, resume_with_changes: bool = False) -> list[Change]:
    """Compare `config` with the one recorded in `workdir` and record it where it may run.

    Returns the changes accepted; raises `WorkdirError` (writing nothing) for a change that
    is unsafe, or safe but not opted into (`resume_with_changes`). Call it holding the lock.
    """
    workdir = Path(workdir)
    path, new = workdir / RECORD_FILE, record_of(config)
    accepted: list[Change] = []
    history: list = []
    if path.exists():
        old = _read_record(path)
        if old.get("format", 1) < RECORD_FORMAT and _has_results(workdir):
            raise WorkdirError(_older_format(workdir, old))
        history = old.get("history", [])
        if old["hash"] == new["hash"] and old["settings"] == new["settings"]:
            return []
        if not _has_results(workdir):
            log.info("%s: no results yet from the config recorded in %s: recording this run's", workdir, path.name)
        else:
            progress = {p: phase_progress(workdir, p) for p in {*registry.PHASES, *old['identity']['phases']}}
            changes = config_changes(old, new, progress)
            unsafe = [c for c in changes if not c.safe]
            if unsafe or not resume_with_changes:
                for c in changes:
                    log.error("%s: %s%s", path, c, "" if c.safe else "  [not safe to change]")
                shown = "; ".join(map(str, (unsafe or changes)[:6]))
                more = len(unsafe or changes) - 6
                shown += f"; and {more} more (all in the log above)" if more > 0 else ""
                if unsafe:
                    raise WorkdirError(f"workdir {workdir} was started with another config, and resuming it with "
                                       f"this one is not safe: {shown}. Use a new --workdir")
                raise WorkdirError(f"workdir {workdir} was started with another config: {shown}. These keys are "
                                   "safe to change: rerun with --resume_with_changes to resume with them")
            accepted = changes
            for c in changes:
                log.warning("%s: resuming with %s", workdir, c)
            history = [*history, {"time": _now(), "changes": [str(c) for c in changes]}]
    elif _has_results(workdir):
        log.warning("%s holds results of an earlier version without a config record (%s): resuming it as it is, "
                    "and recording this run's config", workdir, path.name)
    _write_json(workdir / "config.json", config.to_json_best_effort(indent=2))
    _write_json(path, json.dumps({**new, **({"history": history} if history else {})}, indent=2))
    return accepted


def _older_format(workdir: Path, old: dict) -> str:
    """Why a workdir recorded before the options' renames cannot resume: the renames among
    its keys, and the off values that became None."""
    keys = {**old.get("identity", {}), **old.get("settings", {})}
    renamed = [f"{k} -> {v}" for k, v in RENAMED.items() if k in keys]
    which = f" (its options {', '.join(renamed)})" if renamed else ""
    return (f"workdir {workdir} was started by an earlier jaxrlhf whose options were since renamed{which}, and whose "
            "0 / '' off values are None now (CHANGELOG.md): its checkpoints cannot be resumed by this version. "
            "Resume it with the version that started it, or use a new --workdir")


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _start_time(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of process `pid` from /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started: int | None) -> bool:
    """Whether process `pid` of this host is running and is the one that `started` then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _start_time(pid)
    if stat is None:
        return True
    state, start = stat
    return state != "Z" and (started is None or start == started)


class WorkdirLock:
    """The lock file of a workdir: `acquire(path)` takes it (or raises `WorkdirError`),
    `release()` removes it if it is still this one's."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder = path, holder

    @staticmethod
    def read(path: Path, *, attempts: int = 10) -> dict | None:
        """The holder recorded in lock file `path`; None when there is none. A lock just
        created but not yet written is read again for up to a second."""
        for attempt in range(attempts):
            try:
                return json.loads(Path(path).read_text())
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as e:
                if attempt == attempts - 1:
                    raise WorkdirError(f"lock file {path} is unreadable ({type(e).__name__}: {e}): if you are sure "
                                       f"no run is using {Path(path).parent}, delete {path}") from None
                time.sleep(0.1)
        return None

    @classmethod
    def acquire(cls, path: Path) -> "WorkdirLock":
        path = Path(path)
        stat = _start_time(os.getpid())
        holder = dict(pid=os.getpid(), host=socket.gethostname(), started=stat[1] if stat else None,
                      since=_now(), token=uuid.uuid4().hex, command=" ".join(sys.argv)[:300])
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = cls.read(path)
                if other is not None:
                    cls._take_over_if_stale(path, other)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(holder))
            return cls(path, holder)
        raise WorkdirError(f"could not take the lock {path}: other runs keep taking it; try again")

    @staticmethod
    def _take_over_if_stale(path: Path, other: dict) -> None:
        """Remove `other`'s lock at `path` if its process is gone, else raise `WorkdirError`.
        The removal holds `path.takeover` (created like the lock), so of two runs that find
        the same stale lock only one removes it and a fresh lock is never removed."""
        workdir, pid, host = path.parent, other.get("pid"), other.get("host")
        since = f", since {other['since']}" if other.get("since") else ""
        if host != socket.gethostname():
            raise WorkdirError(f"workdir {workdir} is locked by pid {pid} on host {host}{since}, which cannot be "
                               f"checked from this host: if you are sure no run is using it, delete {path}")
        if not isinstance(pid, int) or _alive(pid, other.get("started")):
            raise WorkdirError(f"workdir {workdir} is in use by another run: pid {pid} on host {host}{since}; "
                               "wait for it to end or use another --workdir")
        guard = path.with_name(path.name + ".takeover")
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            time.sleep(0.2)  # another run is taking it over; see what it left
            if guard.exists():
                raise WorkdirError(f"{guard} exists: another run is taking over the stale lock of {workdir}; if "
                                   f"none is, delete {guard}") from None
            return
        try:
            if WorkdirLock.read(path) == other:
                log.warning("%s: taking over the stale lock of pid %s on host %s%s (that process has ended)",
                            workdir, pid, host, since)
                path.unlink()
        finally:
            guard.unlink()

    def release(self) -> None:
        """Remove the lock file, unless it is no longer this one's (deleted or taken over)."""
        try:
            if WorkdirLock.read(self.path, attempts=1) == self.holder:
                self.path.unlink()
        except (OSError, WorkdirError) as e:
            log.warning("could not release the lock %s: %s", self.path, e)


def _broadcast_error(message: str) -> str:
    """Process 0's `message` ("" = no error) on every process of a multi-process job."""
    from jax.experimental import multihost_utils

    size = 4096
    data = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        raw = message.encode()[:size]
        data[:len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(out.astype(np.uint8)).rstrip(b"\0").decode(errors="replace")


@contextlib.contextmanager
def _release_on_sigterm(lock: WorkdirLock) -> Iterator[None]:
    """A SIGTERM outside a phase (whose loop turns it into a checkpoint and an exit) ends the
    process as it would have, the lock released first. Only where SIGTERM's action is the
    default, in the main thread."""
    def handle(signum, frame):
        lock.release()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        installed = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.signal(signal.SIGTERM, handle)
    except ValueError:  # not the main thread: leave signals alone
        installed = False
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def claim(workdir: str | Path, config, *, resume_with_changes: bool = False) -> Iterator[list[Change]]:
    """Hold `workdir` for a run of `config`: create it, take its lock, then check (and record)
    the config — in that order, so two first starts cannot both record. Yields the accepted
    changes; releases the lock on exit. Raises `WorkdirError` on every process of the job
    when process 0 cannot claim it. The lock is released on exit, on an exception, and on
    a SIGTERM (`_release_on_sigterm`)."""
    workdir = Path(workdir)
    lock, failure, accepted = None, None, []
    if jax.process_index() == 0:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            lock = WorkdirLock.acquire(workdir / LOCK_FILE)
            try:
                accepted = record_config(workdir, config, resume_with_changes=resume_with_changes)
            except BaseException:
                lock.release()
                raise
        except Exception as e:
            if jax.process_count() == 1:
                raise
            failure = e
    if jax.process_count() > 1:
        message = _broadcast_error("" if failure is None else (str(failure) or type(failure).__name__))
        if failure is not None:
            raise failure
        if message:
            raise WorkdirError(f"process 0 could not claim the workdir: {message}")
    try:
        with _release_on_sigterm(lock) if lock is not None else contextlib.nullcontext():
            yield accepted
    finally:
        if lock is not None:
            lock.release()
