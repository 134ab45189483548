"""Reward functions run where the run can stop them: one worker process per function.

`Clocked("pkg.mod:fn", timeout=300)` is called like the function itself (keywords only, TRL's
convention) but runs it in a long-lived worker process of its own, started (`spawn`: no
process that has initialised JAX is ever forked) at its first call. The worker imports the
function by its import path, so only the arguments and the result cross the pipe; it ignores
SIGINT, so a Ctrl-C reaches the run, which then stops the worker. Every call is clocked:

- a call running long logs a progress line every `progress_every` seconds (default
  min(30 s, timeout / 4)): `reward function pkg.mod:fn has run 30 s on 64 completions
  (timeout 300 s)`;
- a call past `timeout` seconds is abandoned, not awaited: the worker is killed (SIGTERM,
  then SIGKILL) and a fresh one serves the next call. `on_timeout="error"` raises
  `RewardTimeout` naming the function, the timeout and `reward.timeout`; `"zero"` scores
  that call's completions 0, logs a warning naming the function, and sets `timed_out` (the
  run's `reward/<name>/timeouts` metric, `rewards.Reward.host_scores`).

What the function raises comes back as in-process: its exception (the worker's traceback as
its cause), `sys.exit` as `RewardFunctionError`, a `KeyboardInterrupt` as one. A worker
that dies (a crash, `os._exit`) is an error naming the function. Workers are stopped when
the process exits (atexit) and at the end of `closing()` (a run, `runs.experiment`).

This module imports no JAX: the worker loads it and the user's module only.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import pickle
import signal
import time
import traceback
import weakref
from typing import Callable

from jaxrlhf import imports

log = logging.getLogger("jaxrlhf")

ON_TIMEOUT = ("error", "zero")
START_TIMEOUT_S = 120.0  # the worker's start-up: Python, the module (already imported once by the run)
_LIVE: "weakref.WeakSet[Clocked]" = weakref.WeakSet()


class RewardFunctionError(RuntimeError):
    """A reward function ended the process (`sys.exit`), ran past its timeout, or its worker
    died, instead of returning its scores."""


class RewardTimeout(RewardFunctionError):
    """A reward function ran past `reward.timeout` (with `reward.on_timeout="error"`)."""


def import_fn(spec: str) -> Callable:
    """The callable at import path `spec`, "package.module:function" (a dotted attribute
    path after the colon works too); a ValueError naming `spec` when it does not import, has
    no such attribute or is not callable."""
    obj = imports.import_object(spec, label=f"reward {spec!r}", what="package.module:function")
    if not callable(obj):
        attr = spec.strip().partition(":")[2]
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def exit_message(spec: str, code) -> str:
    return (f"reward function {spec} called sys.exit({code!r}): a reward function returns its scores and must not "
            "end the process")


# ----------------------------------------------------------------------------- the worker


def _serve(spec: str, conn) -> None:
    """The worker's loop: import `spec`, then answer each call's keywords with
    ("ok", result) | ("exit", code) | ("interrupt",) | ("raise", pickled exception or None,
    type name, message, traceback text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    try:
        fn = import_fn(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the run, which names it
        conn.send(("import_error", str(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            kwargs = conn.recv()
        except EOFError:  # the run closed the pipe: done
            return
        try:
            reply = ("ok", fn(**kwargs))
        except SystemExit as e:
            reply = ("exit", e.code)
        except KeyboardInterrupt:
            reply = ("interrupt",)
        except BaseException as e:  # noqa: BLE001 - any failure of user code goes back to the run
            try:
                exc = pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its name and message
                exc = None
            reply = ("raise", exc, type(e).__name__, str(e), traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - a result that does not pickle
            conn.send(("raise", None, "TypeError", f"returned {type(reply[1]).__name__}, which cannot be sent back "
                       f"from its worker process ({type(e).__name__}: {e}); return a list of floats", ""))


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the cause of the one re-raised)."""

    def __str__(self):
        return self.args[0]


def _remote_exception(pickled: bytes | None, type_name: str, message: str, tb: str) -> BaseException:
    exc = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - e.g. an exception class that needs arguments: rebuilt below
            exc = None
    if not isinstance(exc, BaseException):
        exc = type(type_name, (Exception,), {})(message)
    if tb:
        exc.__cause__ = _RemoteTraceback(f"\n(in the reward function's worker process)\n{tb}")
    return exc


# ----------------------------------------------------------------------------- the run's side


class Clocked:
    """Reward function `spec` ("pkg.mod:fn") called in a worker process under a clock (the
    module's docstring): `clocked(prompts=..., completions=..., **fields)`.

    timeout: seconds per call (> 0). on_timeout: "error" | "zero". progress_every: seconds
    between progress lines (None: min(30, timeout / 4)). `timed_out` says whether the last
    call timed out (and scored 0); `timeouts` counts them.
    """

    def __init__(self, spec: str, *, timeout: float, on_timeout: str = "error", progress_every: float | None = None):
        if not timeout or timeout <= 0:
            raise ValueError(f"reward.timeout={timeout!r}: expected seconds > 0, or 0 for no limit (the "
                             "functions then run in the run's own process)")
        if on_timeout not in ON_TIMEOUT:
            raise ValueError(f"reward.on_timeout={on_timeout!r}: expected one of {ON_TIMEOUT}")
        self.import_path = spec.strip()
        self.__name__ = self.import_path.partition(":")[2].rsplit(".", 1)[-1]  # the function's, as it names a reward
        self.timeout = float(timeout)
        self.on_timeout = on_timeout
        self.progress_every = float(progress_every or min(30.0, self.timeout / 4))
        self.timed_out = False
        self.timeouts = 0
        self._process = self._conn = None

    def __repr__(self):
        return f"Clocked({self.import_path!r}, timeout={self.timeout:g})"

    @property
    def pid(self) -> int | None:
        """The worker's process id (None: none running)."""
        return self._process.pid if self._process is not None else None

    def _start(self):
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(self.import_path, theirs), daemon=True,
                              name=f"reward {self.import_path}")
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        _LIVE.add(self)
        try:
            if not ours.poll(START_TIMEOUT_S):
                raise RewardFunctionError(f"the worker process of reward function {self.import_path} did not start "
                                          f"within {START_TIMEOUT_S:g} s")
            reply = ours.recv()
        except EOFError:
            reply = ("died",)
        except BaseException:
            self.close()
            raise
        if reply[0] != "ready":
            self.close()
            raise RewardFunctionError(reply[1] if reply[0] == "import_error" else
                                      f"the worker process of reward function {self.import_path} ended at start "
                                      f"(exit code {process.exitcode})")

    def __call__(self, **kwargs):
        n = len(kwargs.get("completions", ()))
        self.timed_out = False
        if self._process is None or not self._process.is_alive():
            self.close()
            self._start()
        try:
            self._conn.send(kwargs)
            reply = self._wait(n)
        except BaseException:  # Ctrl-C, SIGTERM's stop, a broken pipe: the call is abandoned
            self.close()
            raise
        if reply is None:
            return self._expired(n)
        kind, *rest = reply
        if kind == "ok":
            return rest[0]
        if kind == "exit":
            raise RewardFunctionError(exit_message(self.import_path, rest[0]))
        if kind == "interrupt":
            raise KeyboardInterrupt
        raise _remote_exception(*rest)

    def _wait(self, n: int):
        """The worker's reply, or None past the timeout; a progress line every
        `progress_every` seconds meanwhile."""
        start = time.monotonic()
        deadline, next_line = start + self.timeout, start + self.progress_every
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            if self._conn.poll(max(0.0, min(deadline, next_line) - now)):
                try:
                    return self._conn.recv()
                except EOFError:
                    self._process.join(1)
                    code = self._process.exitcode
                    self.close()
                    raise RewardFunctionError(f"the worker process of reward function {self.import_path} died "
                                              f"(exit code {code}) while scoring {n} completions") from None
            now = time.monotonic()
            if now >= next_line and now < deadline:
                log.info("reward function %s has run %g s on %d completions (timeout %g s)", self.import_path,
                         round(now - start, 1), n, self.timeout)
                next_line += self.progress_every

    def _expired(self, n: int):
        self.close()  # abandoned: killed, a fresh worker for the next call
        if self.on_timeout == "error":
            raise RewardTimeout(f"reward function {self.import_path} did not return within {self.timeout:g} s "
                                f"(reward.timeout={self.timeout:g}) on {n} completions; its worker was stopped. "
                                "Raise reward.timeout, set reward.on_timeout=zero to score such a batch 0, or "
                                "reward.timeout=None for no limit")
        self.timed_out = True
        self.timeouts += 1
        log.warning("reward function %s did not return within %g s (reward.timeout) on %d completions: scored 0 "
                    "(reward.on_timeout=zero; %d timeout%s so far)", self.import_path, self.timeout, n,
                    self.timeouts, "s" * (self.timeouts > 1))
        return [0.0] * n

    def close(self) -> None:
        """Stop the worker, if one runs (SIGTERM, then SIGKILL); the next call starts one."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        _LIVE.discard(self)
        if conn is not None:
            conn.close()
        if process is not None:
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
            process.join(2)


def close_all() -> None:
    """Stop every worker of this process."""
    for clocked in list(_LIVE):
        clocked.close()


@contextlib.contextmanager
def closing():
    """Every worker started inside is stopped on the way out, whichever way that is."""
    try:
        yield
    finally:
        close_all()


atexit.register(close_all)

__all__ = ["ON_TIMEOUT", "Clocked", "RewardFunctionError", "RewardTimeout", "close_all", "closing", "exit_message",
           "import_fn"]
