"""The train loop's hooks: what runs around each step, as objects the loop calls at named moments.

`loop.run_phase` is a short loop: restore the phase's newest checkpoint, then for each
step take a batch from its `Batches`, run `step(state, batch, rng)`, and call every hook.
Everything else a run does around its steps is a hook (`runs.loop_hooks`), and a user adds
their own, by object (`run_phase(..., hooks=[MyHook()])`) or by import path
(`--config.train.hooks=pkg.mod:MyHook,other.mod:make_hook`, `load_hooks`).

The moments (each method optional; `Hook` has them all as no-ops):

- `on_start(ctx)`: once, after the phase's newest checkpoint was restored (`ctx.meta`
  holds its meta; None on a fresh start) and before the first step (`ctx.start`; the phase
  runs steps `ctx.start + 1 .. ctx.end`, none when it finished in an earlier run).
- `on_step(ctx, step, state, metrics)`: after each update; `step` counts updates from 1,
  `state` is the state after it (`ctx.state`), `metrics` the row of this step, which a
  hook may add to (written after the user's hooks). `ctx.finished`: this step ends the
  phase.
- `on_eval(ctx, step, evaluation)`: after each periodic held-out evaluation (every
  `train.eval_every` steps; the names without `eval/`). It comes from inside the
  evaluation hook's `on_step`, so within step `step` before the later hooks' `on_step`.
- `on_save(ctx, step)`: after a checkpoint of `step` was started (orbax writes it in the
  background; `ctx.checkpointer.wait()` waits for it), from inside the checkpoint hook's
  `on_step`, the last of the step.
- `on_end(ctx, error)`: once, on every way out of the phase (`error`: the exception that
  ends it, None when its steps ran out), in the REVERSE order, like nested `with` blocks.
- `checkpoint_meta(ctx) -> dict`: JSON the hook keeps in each checkpoint's meta, given
  back on resume as `ctx.meta` (a checkpoint written without the hook lacks its keys).

Every moment calls the hooks in one order (`on_end` in reverse), the built-in ones
(`runs.loop_hooks`) around the user's:

1. `CheckMetrics`: the health monitor (`monitor.HealthMonitor`); a NaN/Inf metric raises
   `NonFiniteError`, before anything of the step is saved.
2. `GuardUpdates`: the update guard (`runs.health.UpdateGuard`); a state that is not
   finite, or whose parameters' norm jumped, raises `UnhealthyUpdateError`, before it is
   evaluated or saved. (On resume it also rejects a saved state that is not finite.)
3. `Evaluate`: the periodic held-out evaluation (`eval/*` metrics), then `on_eval` of
   every hook.
4. `StopEarly` (with `train.stop_metric`): early stopping and keep-best
   (`runs.stopping.EarlyStop`): its `on_eval` may end the phase (`ctx.finished`); on the
   phase's last step it adds `early_stop/best_*` and, with keep_best, puts the best
   parameters back into `ctx.state`.
5. the user's hooks, in the order given (`train.hooks`, then `run_phase(hooks=...)`).
6. `WriteMetrics`: the row to `metrics.jsonl` / TensorBoard / W&B every `log_every` steps
   and at the end, and the progress bar.
7. `Preemption`: SIGTERM (and the caller's `should_stop`) turned into `ctx.stopping`, the
   same on every process: this step is saved, then the phase raises `loop.Preempted`.
8. `Checkpoints`: saves every `checkpoint_every` steps, every `checkpoint_every_s`
   seconds of wall-clock time since the last save, at the end and when stopping, keeping
   the newest `keep_checkpoints`; the meta holds every hook's `checkpoint_meta`; then
   `on_save` of every hook. Resuming is its too (`Checkpoints.resume`, before `on_start`).

So a NaN or a poisoned update stops the run before anything is evaluated or saved; a
user's `on_step` sees the step's row with its evaluation, may add metrics to it, and comes
before the step is saved: what it keeps in `checkpoint_meta` is the step's, and an
exception from it stops the run before the step is saved. A step's moments come as
`on_eval` (if it evaluates), `on_step`, `on_save` (if it saves). `on_end` runs in reverse:
the checkpoint save in flight is waited for (at most `SAVE_WAIT_S` after a Ctrl-C) and the
SIGTERM handler put back before the user's `on_end`.

Writing one:

    import optax
    from jaxrlhf.runs.hooks import Hook

    class PrintLoss(Hook):
        def on_step(self, ctx, step, state, metrics):
            metrics["w_norm"] = float(optax.global_norm(state.params))  # written in the row
            if step % 10 == 0:
                print(ctx.phase.name, step, metrics["loss"])

        def on_save(self, ctx, step):
            print("checkpoint", ctx.checkpointer.directory / str(step))

    python -m jaxrlhf.train --config=configs/addition_sft.py --config.train.hooks=my_hooks:PrintLoss

An entry of `train.hooks` is `module:attribute`: a class or a function is called with no
arguments once per phase, anything else (a module-level instance, shared by the phases) is
taken as it is. A user hook's exception stops the run with `HookError` naming it
(`train.hooks: my_hooks:PrintLoss.on_step raised KeyError: 'loss'`), `sys.exit` in one
too; Ctrl-C inside one is reported naming it. In a multi-process job every process calls
every hook (write files from `jax.process_index() == 0` only).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path
from typing import Any

from jaxrlhf import exits

log = logging.getLogger("jaxrlhf")

MOMENTS = ("on_start", "on_step", "on_eval", "on_save", "on_end", "checkpoint_meta")


class HookError(RuntimeError):
    """A user hook (`train.hooks`) raised, or called `sys.exit`: the message names it."""


class Hook:
    """A base with every moment a no-op (see the module docstring); subclass and override."""

    def on_start(self, ctx: Context) -> None:
        pass

    def on_step(self, ctx: Context, step: int, state: Any, metrics: dict) -> None:
        pass

    def on_eval(self, ctx: Context, step: int, evaluation: dict) -> None:
        pass

    def on_save(self, ctx: Context, step: int) -> None:
        pass

    def on_end(self, ctx: Context, error: BaseException | None) -> None:
        pass

    def checkpoint_meta(self, ctx: Context) -> dict:
        return {}


@dataclasses.dataclass(eq=False)
class Context:
    """What the hooks of a phase share: the phase (`loop.PhaseConfig`), its workdir, metrics
    writer, `Checkpointer`, `Batches` and hooks, and the loop's progress. Hooks read it,
    and the built-in ones write the fields they own (named in each)."""

    phase: Any
    workdir: Path
    writer: Any
    checkpointer: Any
    batches: Any
    hooks: tuple = ()
    state: Any = None  # the current train state (`StopEarly` may put the best parameters back)
    start: int = 0  # the step the phase starts from (0, or the restored checkpoint's)
    end: int = 0  # the step the phase runs to (its last, or `start` for a finished phase)
    meta: dict | None = None  # the restored checkpoint's meta (None: a fresh start)
    step: int = 0  # the last update's step (1-based)
    finished: bool = False  # the current step ends the phase (its last, or an early stop)
    stopping: bool = False  # SIGTERM / should_stop: this step is saved, then the phase stops
    saved: int | None = None  # the newest checkpoint's step (None: none yet)
    best: Any = None  # the parameters a checkpoint keeps beside the state (`best` item), or None

    def emit(self, moment: str, *args) -> None:
        """Call `moment` of every hook, in order (`on_eval` and `on_save` come this way)."""
        for hook in self.hooks:
            getattr(hook, moment)(self, *args)

    def end_phase(self, error: BaseException | None) -> None:
        """`on_end` of every hook, in reverse order, each even when one before it raised (a
        hook's exception is then the one the next ones see, and the one raised at the end)."""
        pending = error
        for hook in reversed(self.hooks):
            try:
                hook.on_end(self, pending)
            except BaseException as e:  # noqa: BLE001 - every hook gets its on_end
                if pending is not None and e is not pending and e.__context__ is None:
                    e.__context__ = pending
                pending = e
        if pending is not error:
            raise pending


class UserHook(Hook):
    """A user's hook object under its name (`pkg.mod:Hook`): its moments, where it has them,
    with whatever it raises named (`HookError`), a `sys.exit` too, and a Ctrl-C inside one
    as a KeyboardInterrupt that names it. A SIGTERM's `exits.Stopped` passes through."""

    def __init__(self, name: str, hook: Any):
        self.name, self.hook = name, hook

    def __repr__(self) -> str:
        return f"UserHook({self.name})"

    def _call(self, moment: str, *args):
        method = getattr(self.hook, moment, None)
        if method is None:
            return None
        where = f"{self.name}.{moment}"
        try:
            return method(*args)
        except exits.Stopped:
            raise
        except SystemExit as e:
            raise HookError(f"train.hooks: {where} called sys.exit({e.code!r}): a hook must not end the "
                            "process (raise an exception to stop the run)") from e
        except KeyboardInterrupt as e:
            raise KeyboardInterrupt(f"while running hook {where}") from e
        except Exception as e:
            raise HookError(f"train.hooks: {where} raised {type(e).__name__}: {e}") from e

    def on_start(self, ctx):
        self._call("on_start", ctx)

    def on_step(self, ctx, step, state, metrics):
        self._call("on_step", ctx, step, state, metrics)

    def on_eval(self, ctx, step, evaluation):
        self._call("on_eval", ctx, step, evaluation)

    def on_save(self, ctx, step):
        self._call("on_save", ctx, step)

    def on_end(self, ctx, error):
        self._call("on_end", ctx, error)

    def checkpoint_meta(self, ctx) -> dict:
        meta = self._call("checkpoint_meta", ctx)
        if meta is not None and not isinstance(meta, dict):
            raise HookError(f"train.hooks: {self.name}.checkpoint_meta returned a {type(meta).__name__}, "
                            "not a dict")
        return meta or {}


def name_of(hook: Any) -> str:
    """`pkg.mod:Class` of a hook object (the name its errors carry)."""
    if isinstance(hook, UserHook):
        return hook.name
    cls = hook if isinstance(hook, type) else type(hook)
    return f"{cls.__module__}:{cls.__qualname__}"


def as_user_hook(hook: Any) -> UserHook:
    """`hook` as a `UserHook` (named after its class unless it is one already)."""
    return hook if isinstance(hook, UserHook) else UserHook(name_of(hook), hook)


def _is_hook(obj: Any) -> bool:
    return not isinstance(obj, type) and any(callable(getattr(obj, m, None)) for m in MOMENTS)


def _entries(spec: str | None) -> list[str]:
    if spec is None:
        return []
    if not isinstance(spec, str):
        raise ValueError(f"train.hooks={spec!r}: expected a string of import paths 'pkg.mod:Hook,other.mod:hook'")
    return [x.strip() for x in spec.split(",") if x.strip()]


def _resolve(spec: str, entry: str) -> Any:
    """The attribute `entry` ("pkg.mod:attr", a dotted attribute path after the colon
    working too) names, imported; a one-line ValueError naming `train.hooks` and the entry."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"train.hooks={spec!r}: {entry!r} is not an import path 'package.module:Hook'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or any error the module raises on import
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"train.hooks={spec!r}: module {module_name!r} of {entry!r} does not import "
                         f"({type(e).__name__}: {first}); is its folder on PYTHONPATH?") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"train.hooks={spec!r}: module {module_name!r} has no attribute {attr!r} "
                             f"(entry {entry!r})")
        obj = getattr(obj, part)
    return obj


def check_hooks(spec: str) -> None:
    """Import every entry of `spec` (`train.hooks`) and find its attribute, calling nothing:
    a bad entry is refused before any work."""
    for entry in _entries(spec):
        obj = _resolve(spec, entry)
        if not (callable(obj) or _is_hook(obj)):
            raise ValueError(f"train.hooks={spec!r}: {entry!r} is a {type(obj).__name__}, not a hook class, "
                             "factory or object")


def load_hooks(spec: str) -> tuple[UserHook, ...]:
    """The hooks of `spec`, "pkg.mod:Hook,other.mod:make_hook" (`train.hooks`; None = none):
    each module imported, its attribute taken, and a class or function called with no
    arguments (an object with hook methods is taken as it is). A bad entry is a one-line
    ValueError naming `train.hooks` and the entry."""
    out = []
    for entry in _entries(spec):
        obj = _resolve(spec, entry)
        if not _is_hook(obj):
            if not callable(obj):
                raise ValueError(f"train.hooks={spec!r}: {entry!r} is a {type(obj).__name__}, not a hook class, "
                                 "factory or object")
            try:
                obj = obj()
            except Exception as e:  # noqa: BLE001 - the user's constructor: named
                raise ValueError(f"train.hooks={spec!r}: calling {entry}() raised {type(e).__name__}: {e} "
                                 "(a hook is made with no arguments)") from e
            if not _is_hook(obj):
                raise ValueError(f"train.hooks={spec!r}: {entry}() returned a {type(obj).__name__}, which has none "
                                 f"of the hook methods {', '.join(MOMENTS)}")
        out.append(UserHook(entry, obj))
    return tuple(out)


def check_train(train) -> None:
    """The loop's `train.hooks`, before any work: every entry importable (the other keys'
    bounds are their fields', `runs.sections.TrainConfig`)."""
    check_hooks(train.get("hooks"))


__all__ = ["Context", "Hook", "HookError", "MOMENTS", "UserHook", "as_user_hook", "check_hooks", "check_train",
           "load_hooks", "name_of"]
