"""XLA flags of the processes the test suite runs: pytest's own (`conftest.py` sets them)
and the subprocesses it starts (`flags(devices)` in their environment).

The suite compiles hundreds of tiny programs whose run time is negligible, so LLVM's code
generation dominates it; at `-O0` a test file's CPU time fell from 111 s to 65 s
(tests/algorithms/test_dpo.py, measured 2026-12-02). Every test compares programs compiled
alike, or one program with a float64 reference within a tolerance, so the optimisation
level changes no outcome; the library itself runs at XLA's default level.
"""

from __future__ import annotations

FAST_COMPILE = "--xla_backend_optimization_level=0"


def flags(devices: int | None = None, base: str | None = None) -> str:
    """`base` (e.g. the caller's XLA_FLAGS), the fast-compile flag, and `devices` forced
    host CPU devices if given."""
    parts = [base or "", FAST_COMPILE if FAST_COMPILE not in (base or "") else ""]
    if devices:
        parts.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(p for p in parts if p)
