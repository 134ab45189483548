"""Prompt-length buckets and a compile counter: a handful of programs for a real dataset.

Every new prompt length P is a new shape, so the sampler and the update recompile (26–45 s
each for a 135M model on CPU). `pad_to_bucket` left-pads a `[B, P]` batch to the smallest
bucket length ≥ P, so prompts of any length compile once per bucket. Left padding never
changes a result: padded slots are masked out of attention and positions count real tokens
only (the model's padding-invariance tests).

`CompileCounter` counts XLA compilations (JAX's `/jax/core/compile/backend_compile_duration`
events) while it is open, so an iteration can report `time/compiles` in its metrics: 0 on every
step after the first of each shape.
"""

from __future__ import annotations

import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Powers of two: at most 2x the prompt's compute, log2(longest/shortest) programs.
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket_length(p: int, buckets: Sequence[int], *, limit: int | None = None) -> int:
    """The smallest bucket ≥ `p`, at most `limit` (the longest prompt the cache allows); `p`
    itself when no bucket fits (longer than every bucket, or the fitting ones exceed `limit`)."""
    fits = [b for b in buckets if p <= b and (limit is None or b <= limit)]
    return min(fits) if fits else p


def pad_to_bucket(prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array, buckets: Sequence[int] | None, *,
                  pad_id: int = 0, limit: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`(ids, mask)` left-padded to `bucket_length(P, buckets, limit=limit)` columns (`pad_id`,
    mask 0); unchanged when `buckets` is None or empty, or P already is that length."""
    if not buckets:
        return prompt_ids_BxP, prompt_mask_BxP
    p = prompt_ids_BxP.shape[1]
    extra = bucket_length(p, buckets, limit=limit) - p
    if extra == 0:
        return prompt_ids_BxP, prompt_mask_BxP
    widths = ((0, 0), (extra, 0))
    if all(_on_host(x) for x in (prompt_ids_BxP, prompt_mask_BxP)):  # NumPy: no XLA program per shape
        return (np.pad(np.asarray(prompt_ids_BxP), widths, constant_values=pad_id),
                np.pad(np.asarray(prompt_mask_BxP), widths))
    return (jnp.pad(prompt_ids_BxP, widths, constant_values=pad_id), jnp.pad(prompt_mask_BxP, widths))


def _on_host(x) -> bool:
    """Readable as one NumPy array without a collective: concrete and fully addressable."""
    return not isinstance(x, jax.core.Tracer) and (not isinstance(x, jax.Array) or x.is_fully_addressable)


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_open: list["CompileCounter"] = []
_registered = False


def _on_event(name: str, duration: float, **kwargs) -> None:
    if name == _COMPILE_EVENT:
        with _lock:
            for counter in _open:
                counter.count += 1


class CompileCounter:
    """`with CompileCounter() as c: ...` then `c.count`: XLA compilations while open (any
    thread, so a counter open across concurrent work counts that work's compiles too)."""

    def __init__(self):
        self.count = 0

    def __enter__(self) -> "CompileCounter":
        global _registered
        with _lock:
            if not _registered:
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                _registered = True
            _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open.remove(self)
