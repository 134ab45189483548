"""Hooks that tests/runs/test_hooks.py names by import path (`_user_hook:Recorder`, this
folder on sys.path / PYTHONPATH): each records what it saw in `EVENTS` and, when the
environment names a file in `USER_HOOK_LOG` (a run in a subprocess), as JSON lines there."""

from __future__ import annotations

import json
import os

EVENTS: list = []
NOT_A_HOOK = 3


def record(*event) -> None:
    EVENTS.append(list(event))
    path = os.environ.get("USER_HOOK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(list(event)) + "\n")


class Recorder:
    """Every moment, with the phase, the step and whether the row holds the evaluation."""

    def on_start(self, ctx):
        record("start", ctx.phase.name, ctx.start)

    def on_step(self, ctx, step, state, metrics):
        record("step", ctx.phase.name, step, any(k.startswith("eval/") for k in metrics))

    def on_eval(self, ctx, step, evaluation):
        record("eval", ctx.phase.name, step)

    def on_save(self, ctx, step):
        record("save", ctx.phase.name, step)

    def on_end(self, ctx, error):
        record("end", ctx.phase.name, type(error).__name__ if error is not None else None)


def make_recorder() -> Recorder:
    return Recorder()


class Counter:
    """Counts the steps it saw, kept in the checkpoints: a resumed run counts on."""

    def __init__(self):
        self.count = 0

    def on_start(self, ctx):
        self.count = (ctx.meta or {}).get("counter", 0)

    def on_step(self, ctx, step, state, metrics):
        self.count += 1

    def checkpoint_meta(self, ctx):
        return {"counter": self.count}

    def on_end(self, ctx, error):
        record("count", self.count)


class Raising:
    def on_step(self, ctx, step, state, metrics):
        if step == 2:
            raise RuntimeError("boom at step 2")


class Exiting:
    def on_save(self, ctx, step):
        raise SystemExit(3)


class NeedsArguments:
    def __init__(self, threshold):
        self.threshold = threshold

    def on_step(self, ctx, step, state, metrics):
        pass
