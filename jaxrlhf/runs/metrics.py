"""Metrics to `metrics.jsonl` and TensorBoard event files, written by process 0 only."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import numpy as np


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


class MetricsWriter:
    def __init__(self, workdir: str | Path, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, step: int, metrics: dict, *, prefix: str = "") -> None:
        if not self.enabled:
            return
        scalars = {f"{prefix}{k}": v for k, v in to_python(metrics).items() if isinstance(v, float)}
        record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(tensorboard_tag(k), v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
