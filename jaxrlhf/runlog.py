"""The run's log file, `<workdir>/train.log`: every log line of a `python -m jaxrlhf.train`
run and, when it fails, the full traceback.

The command line (`jaxrlhf.cli`) calls `capture()` first: from then on log records are
kept in memory (and shown on stderr as before). `train_and_evaluate` calls `attach(workdir)`
once the run owns its workdir (after the workdir checks, where the workdir is first
written); the file is opened in append mode, a header marks the start of this run, the
records kept so far are written, and later ones follow as they come. A run that fails
before it owns a workdir (a config error, a refused start) writes no file at all, so a
refused start leaves the workdir untouched: its traceback is shown only with
`JAXRLHF_TRACEBACK=1`. Without `capture()` (library use, tests) `attach` does nothing.

In a multi-process job only process 0 writes `train.log` (the other processes' stderr is
kept by their launcher).

Writing the log never stops a run, nor the report of its failure: when the file cannot be
written (a full disk), one warning says so on stderr and the lines go on on stderr alone
(`_RunLog.handleError`), and `note` / `write_failure` return None instead of raising.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import traceback
from pathlib import Path

LOG_NAME = "train.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MAX_KEPT = 10_000  # records kept in memory before the workdir is known


class _Keep(logging.Handler):
    """Keeps the formatted records of the start of a run, until `attach` writes them."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        if "file" not in _state and len(self.lines) < _MAX_KEPT:
            self.lines.append(self.format(record))


class _RunLog(logging.FileHandler):
    """`train.log`'s handler: a record it cannot write (a full disk) is not a page of
    "--- Logging error ---" on stderr but one warning, once; the lines are on stderr anyway."""

    failed = False

    def handleError(self, record):
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            try:
                sys.stderr.write(f"warning: cannot write the run log {self.baseFilename} ({error}); its lines go "
                                 "to stderr only\n")
            except Exception:  # noqa: BLE001 - stderr gone too: nothing to tell
                pass


_state: dict = {}  # "keep": the _Keep handler (capture() was called); "file": the FileHandler; "path"


def capture() -> None:
    """Start keeping this process's log records for the run log (called by the command line)."""
    if "keep" not in _state:
        keep = _Keep()
        keep.setFormatter(logging.Formatter(_FORMAT))
        logging.getLogger().addHandler(keep)
        _state["keep"] = keep


def attach(workdir: str | os.PathLike, *, main_process: bool = True) -> Path | None:
    """Append this run's log to `<workdir>/train.log`: a header, the records kept since
    `capture()`, and every later record. Returns the file's path; None (nothing written)
    without `capture()` or on a process other than the main one."""
    keep = _state.get("keep")
    if keep is None or not main_process:
        return None
    path = Path(workdir).absolute() / LOG_NAME
    if _state.get("path") == path:
        return path
    detach()
    handler = _RunLog(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    handler.stream.write(f"\n===== {stamp} run start: pid {os.getpid()} on {socket.gethostname()}: "
                         f"{' '.join(sys.argv)}\n" + "".join(line + "\n" for line in keep.lines))
    handler.flush()
    keep.lines.clear()
    logging.getLogger().addHandler(handler)
    _state.update(file=handler, path=path)
    return path


def detach() -> None:
    """Stop writing the run log (the file is closed)."""
    handler = _state.pop("file", None)
    _state.pop("path", None)
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()


def path() -> Path | None:
    """The run log this process writes, or None."""
    return _state.get("path")


def note(text: str) -> Path | None:
    """`<time> <text>` appended to the run log; returns its path, or None when there is no
    run log or it cannot be written (a full disk). Never raises: the caller is reporting how
    the run ended."""
    handler = _state.get("file")
    if handler is None:
        return None
    try:
        handler.stream.write(f"{datetime.datetime.now().isoformat(timespec='seconds')} {text}\n")
        handler.stream.flush()
    except Exception:  # noqa: BLE001 - OSError (no space), a closed stream
        return None
    return _state["path"]


def write_failure(exc: BaseException) -> Path | None:
    """The full traceback of `exc` appended to the run log (`note`); its path, or None."""
    return note("run failed:\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())


__all__ = ["LOG_NAME", "attach", "capture", "detach", "note", "path", "write_failure"]
