"""How a `python -m jaxrlhf.train` run stops: its signals and the last line it prints.

Every way out ends stderr with one line (`jaxrlhf.cli.run_main` prints it):

- a failure: `error: <what went wrong> (<where the full traceback is>)`, status 1; a full
  disk says so and which checkpoints are intact (`no_space`);
- SIGTERM (a preemption): `stopped by SIGTERM: the checkpoint(s) <phase>/<step> in <workdir>
  are kept; rerun the same command to resume`, status 0. Inside a phase the step loop
  finishes the step and saves it first (`runs.loop`); anywhere else (an evaluation,
  between phases, the export) every finished phase is already saved, and the run stops at
  once (`Stopped`), the export's temporary folder removed;
- Ctrl-C: `error: interrupted (Ctrl-C)[ while running reward function pkg.mod:fn]: <what is
  kept>`, status 130, after waiting a bounded time for a checkpoint save in flight; a second
  Ctrl-C ends the process at once.

`install()` puts the command line's handlers in place; library use (`train_and_evaluate`
in a notebook) keeps Python's own. `signal_at(moment)` is a test hook.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import signal
from pathlib import Path

TEST_SIGNAL_ENV = "JAXRLHF_TEST_SIGNAL_AT"
MOMENTS = ("between_phases", "eval", "save", "export")  # where `signal_at` is called

log = logging.getLogger("jaxrlhf")
_state: dict = {"workdir": None, "seen": collections.Counter(), "interrupted": False}


class Stopped(SystemExit):
    """A run stopped by a signal (status 0): what it finished is saved and a rerun resumes."""

    def __init__(self, signal_name: str = "SIGTERM"):
        super().__init__(0)
        self.signal_name = signal_name


def install() -> None:
    """The command line's handlers (main thread): SIGTERM raises `Stopped` (a phase's step
    loop first turns it into a checkpoint, `runs.loop`), later ones are ignored while the run
    stops; the first Ctrl-C raises KeyboardInterrupt, a second ends the process at once."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean stop; SIGKILL remains for a hung one
    log.warning("SIGTERM received: stopping (every finished phase is saved)")
    raise Stopped("SIGTERM")


def _on_sigint(signum, frame):
    signal.signal(signal.SIGINT, _at_once)
    _state["interrupted"] = True  # for `raise_if_interrupted`, should code under us swallow the exception
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C arrived whose KeyboardInterrupt never reached the
    run: raised where Python only prints an exception (a `__del__`, a callback of orbax's
    save) or caught by library code. The step loop calls it at every step and after the
    last one, and the command line before it reports success, so a Ctrl-C always ends the
    run with status 130."""
    if _state["interrupted"]:
        raise KeyboardInterrupt


def _at_once(signum, frame):
    os.write(2, b"\nerror: interrupted twice (Ctrl-C): stopped at once, without cleaning up\n")
    os._exit(130)


def signal_at(moment: str) -> None:
    """Test hook, inert unless `JAXRLHF_TEST_SIGNAL_AT=<moment>[#<n>]:<SIGTERM|SIGINT>` is set:
    the process sends itself that signal the n-th time (default: the first) the run reaches
    `moment`, one of `MOMENTS` (the tests of tests/runs/test_exits.py)."""
    spec = os.environ.get(TEST_SIGNAL_ENV)
    if not spec:
        return
    where, _, name = spec.rpartition(":")
    target, _, nth = where.partition("#")
    if target != moment:
        return
    _state["seen"][moment] += 1
    if _state["seen"][moment] == int(nth or 1):
        log.warning("test hook %s: %s at %s", TEST_SIGNAL_ENV, name, moment)
        signal.raise_signal(getattr(signal, name))


def set_workdir(workdir: str | os.PathLike) -> None:
    """The workdir whose checkpoints the last line names."""
    _state["workdir"] = Path(workdir).absolute()


def checkpoints(workdir: str | os.PathLike | None = None) -> list[str]:
    """`["sft/4", "grpo/2"]`: the newest finished checkpoint of each phase folder of
    `workdir` (default: `set_workdir`'s), the oldest first. Orbax names a finished step
    `<step>`, one still being written `<step>.orbax-checkpoint-tmp-*`."""
    workdir = Path(workdir) if workdir is not None else _state["workdir"]
    found = []
    try:
        for phase in workdir.iterdir() if workdir is not None else ():
            steps = [p for p in phase.iterdir() if p.name.isdigit() and p.is_dir()] if phase.is_dir() else []
            if steps:
                newest = max(steps, key=lambda p: int(p.name))
                found.append((newest.stat().st_mtime, f"{phase.name}/{newest.name}"))
    except OSError:  # an unreadable workdir: nothing to name
        return []
    return [name for _, name in sorted(found)]


def kept(word: str = "kept") -> str:
    """`the checkpoints sft/4, grpo/2 in /w are kept` (`word`: "kept", "intact"), or that
    there is none yet."""
    names, workdir = checkpoints(), _state["workdir"]
    if not names:
        return "no checkpoint was written yet" + (f" in {workdir}" if workdir else "")
    many = len(names) > 1
    return f"the checkpoint{'s' if many else ''} {', '.join(names)} in {workdir} {'are' if many else 'is'} {word}"


def _again() -> str:
    return "rerun the same command to " + ("resume" if checkpoints() else "start again")


def stopped_line(stop: Stopped) -> str:
    """The last line of a run stopped by a signal (status 0)."""
    return f"stopped by {stop.signal_name}: {kept()}; {_again()}"


def interrupted_line(interrupt: KeyboardInterrupt) -> str:
    """The last line of a run stopped by Ctrl-C (status 130); the interrupt's message says
    what it interrupted (e.g. `while running reward function pkg.mod:fn`)."""
    what = str(interrupt).strip()
    return f"error: interrupted (Ctrl-C){' ' + what if what else ''}: {kept()}; {_again()}"


def full_disk(exc: BaseException) -> BaseException | None:
    """The exception of `exc`'s chain (its causes and contexts) that says the disk is full:
    an OSError with errno ENOSPC, or an orbax/TensorStore error whose message says so. None
    when there is none."""
    seen, error = set(), exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def no_space(exc: BaseException) -> str | None:
    """For a failure caused by a full disk (`full_disk`): `no space left on device writing
    <path>: <the checkpoints that are intact>; ...`. None for any other failure."""
    error = full_disk(exc)
    if error is None:
        return None
    path = getattr(error, "filename", None) or _state["workdir"] or "the workdir"
    return (f"no space left on device writing {path}: {kept('intact')}; free some space and rerun the same "
            "command to resume")


__all__ = ["MOMENTS", "TEST_SIGNAL_ENV", "Stopped", "checkpoints", "full_disk", "install", "interrupted_line",
           "kept", "no_space", "raise_if_interrupted", "set_workdir", "signal_at", "stopped_line"]
