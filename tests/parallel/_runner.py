"""Runs `_check_8dev.py` in a fresh process (8 CPU devices there, never here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _xla
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def checkout_env(env: dict) -> dict:
    """`env` with this checkout first on PYTHONPATH: a subprocess started from a script in
    tests/ would otherwise import whichever `jaxrlhf` is installed (e.g. another worktree's
    editable install), not the one under test."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))


def run_checks(names, out_dir) -> dict:
    """Run `_check_8dev.py` on `names` in a fresh process; `{name: {"ok", "detail"}}`."""
    out = out_dir / "results.json"
    env = checkout_env({k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")})
    env["XLA_FLAGS"] = _xla.flags()  # the check script adds its device count
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_check_8dev.py"), str(out), *names],
                          env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the 8-device check process died (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())
