"""Host-memory allocator settings that let XLA:CPU reuse its buffers between steps.

XLA:CPU allocates the temporaries of every execution afresh with `malloc`. Under glibc's
defaults a block of tens of MiB is served by a new `mmap` and unmapped again on `free`,
so every step first-touches all of its temporaries page by page: on the benchmarks' train
step (`benchmarks/bench_train_step.py`, [16, 96] tokens, 2-core CPU) that is about 47,000 page
faults (~180 MiB zeroed by the kernel) per step. Keeping freed memory in the heap leaves
2,300–4,600 and took the step from 0.32–0.35 s to 0.25–0.26 s (median of 20 steps,
three runs each way).

`tune_host_allocator()` sets three glibc `mallopt` parameters for the running process:

- `M_MMAP_THRESHOLD` = 2**31 − 1: blocks under 2 GiB come from the heap, not `mmap`;
- `M_TRIM_THRESHOLD` = 2**31 − 1: freed heap memory is kept for reuse, not returned;
- `M_ARENA_MAX` = 1: XLA's worker threads share the main heap (a thread's own arena is
  capped at 64 MiB and would send large blocks back to `mmap`).

It is off unless asked for, because it is not free. Freed blocks stay in the process, so
its resident memory stays at its peak and fragmentation can raise that peak (the DPO
benchmark's jaxrlhf worker: 1,272 MiB before, 1,466–2,098 MiB with it); and with one heap
every thread's `malloc` takes the same lock, which slows XLA's multi-threaded compiler and
the host side: the whole default task (`configs/addition_grpo.py`, many short programs)
took 76 s with it against 55 s without, and the model and op tests 71 s against 58 s. It
pays for long runs of the same large step; measure your own job both ways.

Turn it on with `JAXRLHF_HOST_ALLOCATOR=reuse` (`python -m jaxrlhf.train` reads it) or by
calling `tune_host_allocator("reuse")` before the first JAX computation (it only affects
threads that have not allocated yet). The benchmarks run with it, on every side. The same
settings from the shell, for any program:

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=2147483647 MALLOC_TRIM_THRESHOLD_=2147483647
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

ENV_VAR = "JAXRLHF_HOST_ALLOCATOR"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_KEEP = 2**31 - 1  # mallopt takes an int


def tune_host_allocator(choice: str | None = None) -> bool:
    """Makes glibc keep and reuse freed memory (see the module docstring).

    Args:
      choice: "reuse" (apply the settings) or "default" (leave the C library alone); None
        reads `JAXRLHF_HOST_ALLOCATOR`, which defaults to "default".

    Returns True when the settings were applied; False when not asked for, or on a C library
    other than glibc. Idempotent.

    Raises:
      ValueError: the choice (or `JAXRLHF_HOST_ALLOCATOR`) is not "reuse" or "default".
    """
    source = "choice" if choice is not None else ENV_VAR
    choice = os.environ.get(ENV_VAR, "default") if choice is None else choice
    if choice not in ("reuse", "default"):
        raise ValueError(f"{source}={choice!r}: expected 'reuse' (keep freed memory for reuse) or 'default' "
                         "(the C library's own settings, the default)")
    if choice == "default" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    applied = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _KEEP), (_M_TRIM_THRESHOLD, _KEEP), (_M_ARENA_MAX, 1)))
    if not applied:
        logger.warning("glibc refused a mallopt setting; XLA:CPU buffers may be re-mapped every step")
    return applied
