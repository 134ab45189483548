"""Metrics to `metrics.jsonl`, TensorBoard event files and (optionally) Weights & Biases,
written by process 0 only.

A resumed phase first cuts the log back to its checkpoint (`MetricsWriter.start_phase`),
so that the log of an interrupted and resumed run equals an uninterrupted run's:
`metrics.jsonl` loses the rows written after the checkpoint (the phase's later steps and
any later phase's rows; the file is rewritten atomically), and the phase's TensorBoard
events, one event folder per phase (`tensorboard/<phase>/`), get a purge marker that
makes TensorBoard drop the phase's events from the restored step on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("jaxrlhf")


def to_python(metrics: dict) -> dict:
    """Device scalars -> floats (NaN and Inf kept as such, JSON writes them as strings)."""
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        out[k] = float(v) if v.size == 1 else v.tolist()
    return out


_TAG_INVALID = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
    r"""The TensorBoard tag of metric `name`: tags allow only `[-/\w.]`, so `@` becomes
    `_at_` (`grpo/eval/pass@4` -> `grpo/eval/pass_at_4`) and any other character `_`
    (tensorboardX would make it `_` and log a line per write). `metrics.jsonl` keeps `name`."""
    return _TAG_INVALID.sub("_", name.replace("@", "_at_"))


def _phase_of(row: dict) -> str | None:
    """The phase a `metrics.jsonl` row belongs to: the prefix of its metric names."""
    return next((k.split("/", 1)[0] for k in row if k != "step"), None)


def rows_before_resume(lines: list[str], phase: str, step: int) -> int:
    """How many leading lines of `metrics.jsonl` an uninterrupted run has written when
    `phase` is about to run its step `step + 1`: the rows before the first one that is
    `phase`'s with a later step, another phase's after `phase`'s own (a later phase), or
    not a whole JSON row (cut short by a crash)."""
    seen = False
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            return i
        if not isinstance(row, dict):
            return i
        if _phase_of(row) == phase:
            if row.get("step", 0) > step:
                return i
            seen = True
        elif seen:
            return i
    return len(lines)


def start_wandb(workdir: str | Path, *, project: str, mode: str = "", config: dict | None = None):
    """A Weights & Biases run for `workdir` (files under `<workdir>/wandb`, named after the
    workdir). `mode` "" = "online" when WANDB_API_KEY is set, else "offline" (no network
    needed; `wandb sync <workdir>/wandb/offline-run-*` uploads it later)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("train.wandb=True needs the wandb package: pip install 'jaxrlhf[wandb]' "
                         "(or set train.wandb=False)") from None
    mode = mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    if mode not in ("online", "offline"):
        raise ValueError(f"train.wandb_mode={mode!r}; expected 'online', 'offline' or None (automatic)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=workdir.name, dir=str(workdir), mode=mode, config=config or {})


class MetricsWriter:
    """`write(step, metrics, phase=...)` appends a row `{"step", "<phase>/<name>": value}` to
    `metrics.jsonl`, the scalars to `tensorboard/<phase>/` and to the Weights & Biases run
    `wandb_run` (if given; each phase's metrics against its own `<phase>/step`);
    `start_phase` cuts the first two back before a phase (re)starts. On processes other
    than 0 it does nothing."""

    def __init__(self, workdir: str | Path, *, tensorboard: bool = True, wandb_run=None):
        self.enabled = jax.process_index() == 0
        self.workdir = Path(workdir)
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run if self.enabled else None
        self._jsonl = None
        self._tb: dict = {}
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / "metrics.jsonl", "a", buffering=1)

    def start_phase(self, phase: str, step: int) -> None:
        """Before `phase` runs from its step `step` (0: from the start): drops the rows an
        earlier, interrupted run wrote past that point (`rows_before_resume`) from
        `metrics.jsonl`, rewritten atomically, and opens the phase's event folder with a
        purge marker at `step + 1` when it holds events already."""
        if not self.enabled:
            return
        path = self.workdir / "metrics.jsonl"
        self._jsonl.flush()
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        keep = rows_before_resume(lines, phase, step)
        if keep < len(lines):
            self._jsonl.close()
            kept = "".join(lines[:keep])
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(kept if kept.endswith("\n") or not kept else kept + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._jsonl = open(path, "a", buffering=1)
            log.info("%s: removed %d row(s) of metrics.jsonl written after step %d (not in its checkpoint)",
                     phase, len(lines) - keep, step)
        if self.tensorboard:
            self._open_events(phase, purge=step + 1)

    def _open_events(self, phase: str, purge: int | None = None):
        """The phase's TensorBoard writer. A folder that holds events of an earlier run gets
        the purge marker at step `purge`: TensorBoard then drops its events from that step
        on. Files are named with the time in ns too: a writer opened within the same second
        as the last one must not overwrite that one's file."""
        if phase not in self._tb:
            from tensorboardX import SummaryWriter

            folder = self.workdir / "tensorboard" / phase
            earlier = folder.is_dir() and any(folder.glob("events.out.tfevents.*"))
            self._tb[phase] = SummaryWriter(str(folder), purge_step=purge if earlier else None,
                                            filename_suffix=f".{time.time_ns()}")
        return self._tb[phase]

    def write(self, step: int, metrics: dict, *, phase: str) -> None:
        """One row of `phase`'s metrics at `step` (scalars only; NaN/Inf as strings in JSON)."""
        if not self.enabled:
            return
        scalars = {f"{phase}/{k}": v for k, v in to_python(metrics).items() if isinstance(v, float)}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self.tensorboard:
            events = self._open_events(phase)
            for k, v in scalars.items():
                events.add_scalar(tensorboard_tag(k), v, step)
        if self.wandb_run is not None:
            self.wandb_run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self.wandb_run.log({f"{phase}/step": int(step), **scalars})

    def write_completions(self, rows: list[dict], *, phase: str, step: int) -> None:
        """Sampled completions (`runs.completions.completion_rows`) appended to
        `completions.jsonl`, one JSON object a row, and logged as the Weights & Biases table
        `<phase>/completions` at `<phase>/step` (token ids left out of the table)."""
        if not self.enabled or not rows:
            return
        rows = [{"phase": phase, "step": int(step), **r} for r in rows]
        with open(self.workdir / "completions.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.wandb_run is not None:
            import wandb

            columns = [k for k in rows[0] if not k.endswith("_ids")]
            table = wandb.Table(columns=columns, data=[[r.get(k) for k in columns] for r in rows])
            self.wandb_run.log({f"{phase}/step": int(step), f"{phase}/completions": table})

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for events in self._tb.values():
            events.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
