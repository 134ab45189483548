"""Two processes × 2 CPU devices joined by `jax.distributed` (gloo) on 127.0.0.1.

A few steps of the small policy-gradient step from host-local batches must give the
single-process result; the Orbax checkpoint written by both processes restores into
another mesh (checked in the workers).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _xla  # noqa: E402
from _runner import checkout_env  # noqa: E402

NPROC = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(steps: int):
    import _models as M
    from jaxrlhf.algorithms.common import TrainState
    from jaxrlhf.models import random_init

    model, params = random_init(M.LLAMA, seed=0)
    tx = M.optimizer()
    state = TrainState.create(params, tx)
    step = jax.jit(M.make_step(model, tx))
    metrics = []
    for i in range(steps):
        state, m = step(state, M.batch(i), jax.random.key(i))
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.mark.heavy  # two processes: the multi-host tier
def test_two_processes_match_single_process(tmp_path):
    env = checkout_env({k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_", "JAXRLHF_"))})
    env["XLA_FLAGS"] = _xla.flags()  # the worker adds its device count
    port = _free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(NPROC)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_multiproc_worker.py"), str(i), str(NPROC),
                               str(port), str(tmp_path)], env=env, stdout=logs[i], stderr=subprocess.STDOUT)
             for i in range(NPROC)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    text = "\n".join((tmp_path / f"p{i}.log").read_text()[-3000:] for i in range(NPROC))
    assert codes == [0] * NPROC, f"workers exited with {codes}:\n{text}"

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3, "metrics must be written once per step, by process 0 only"
    ref_state, ref_metrics = _reference(len(lines))
    for line, ref in zip(lines, ref_metrics):
        got = json.loads(line)
        for k in ("loss", "grad_norm", "clipfrac", "approx_kl"):
            np.testing.assert_allclose(got[k], float(ref[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    params = np.load(tmp_path / "params.npz")
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(ref_state.params))[0]}
    assert set(params.files) == set(flat)
    for name, want in flat.items():
        np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
