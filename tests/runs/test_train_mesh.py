"""`python -m jaxrlhf.train` on a device mesh from the config, against a single device.

Every run is a subprocess (8 forced CPU devices, or two processes × 2 CPU devices joined
by gloo through `launch/local_multiprocess.sh`), so no XLA flag reaches this process. The
runs start together and are compared by their `metrics.jsonl` and `summary.json`:

- GRPO `:tiny` on (fsdp=4, tensor=2) and PPO `:tiny` on (data=2, fsdp=4) equal the
  single-device runs of the same configs within float32 tolerance;
- GRPO `:tiny` on two processes × 2 devices, mesh (fsdp=2, tensor=2), writes its metrics
  once and equals the single-process run;
- the checkpoints of the (fsdp=4, tensor=2) run resume on (data=2, fsdp=2, tensor=2) for
  two more GRPO steps, which equal those of an uninterrupted single-device run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import _xla
import numpy as np
import pytest

pytestmark = pytest.mark.heavy  # command-line meshes; sharded = one device also in parallel/ and runs/test_sampled_eval.py

REPO = Path(__file__).resolve().parents[2]
GRPO = [f"--config={REPO}/configs/addition_grpo.py:tiny"]
# PPO without the SFT warm start, mid-run evaluations or export: four models, two phases.
PPO = [f"--config={REPO}/configs/addition_ppo.py:tiny", "--config.sft.steps=0", "--config.reward_model.steps=2",
       "--config.ppo.steps=2", "--config.train.eval_every=0", "--config.train.export=False"]
NO_EXPORT = ["--config.train.export=False"]  # the mesh runs gather the params and export them
TIMEOUT = 600


def _env(devices: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_", "JAXRLHF_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = _xla.flags(devices)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    """A `python -m jaxrlhf.train` subprocess writing into `workdir`, its output in `log`."""

    def __init__(self, root: Path, name: str, args, *, devices=None, processes=None, workdir=None):
        self.name, self.workdir, self.log = name, Path(workdir or root / name), root / f"{name}.log"
        train = [sys.executable, "-m", "jaxrlhf.train", *args, f"--workdir={self.workdir}"]
        if processes:
            self.logs = root / f"{name}_logs"
            cmd = ["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", str(processes), "-d", str(devices),
                   "--port", str(_free_port()), "--", *train]
            env = dict(_env(), LOG_DIR=str(self.logs))
        else:
            cmd, env = train, _env(devices)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        self.deadline = time.monotonic() + TIMEOUT

    def wait(self) -> "_Run":
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self

    def check(self) -> "_Run":
        text = self.log.read_text()
        if hasattr(self, "logs"):
            text += "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))
        assert self.proc.returncode == 0, f"{self.name} exited with {self.proc.returncode}:\n{text[-6000:]}"
        return self

    def rows(self) -> list[dict]:
        lines = (self.workdir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "time/" not in k} for line in lines]

    def summary(self) -> dict:
        return json.loads((self.workdir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_mesh")
    started = {
        "grpo_mesh": _Run(root, "grpo_mesh", [*GRPO, "--config.mesh=fsdp=4,tensor=2"], devices=8),
        "grpo_2proc": _Run(root, "grpo_2proc", [*GRPO, "--config.mesh=fsdp=2,tensor=2"], devices=2, processes=2),
        "ppo_mesh": _Run(root, "ppo_mesh", [*PPO, "--config.mesh=data=2,fsdp=4"], devices=8),
        # the reference for the GRPO runs and the resumed one: 5 GRPO steps (a constant
        # learning rate, so its first 3 steps are those of the 3-step tiny config)
        "grpo_ref": _Run(root, "grpo_ref", [*GRPO, *NO_EXPORT, "--config.grpo.steps=5"]),
        "ppo_ref": _Run(root, "ppo_ref", PPO),
    }
    mesh = started["grpo_mesh"].wait()
    if mesh.proc.returncode == 0:  # resume a copy of its checkpoints on another mesh, 2 steps further
        shutil.copytree(mesh.workdir, root / "grpo_resumed")
        started["grpo_resumed"] = _Run(root, "grpo_resumed", [*GRPO, *NO_EXPORT, "--config.grpo.steps=5",
                                                              "--config.mesh=data=2,fsdp=2,tensor=2",
                                                              "--resume_with_changes"], devices=8)
    for run in started.values():
        run.wait()
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()


def _assert_rows_match(got: list[dict], want: list[dict], what: str):
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (what, g["step"], sorted(set(g) ^ set(w)))
        for k in g:
            # A clip fraction counts tokens on a threshold, where one rounding flips a token.
            tol = dict(rtol=0, atol=0.1) if "clipfrac" in k else dict(rtol=1e-3, atol=1e-5)
            np.testing.assert_allclose(g[k], w[k], **tol, err_msg=f"{what}: step {g['step']} {k}")


def _assert_stages_match(got: dict, want: dict, stages, what: str):
    for stage in stages:
        for k, v in want["stages"][stage].items():
            np.testing.assert_allclose(got["stages"][stage][k], v, rtol=1e-3, atol=1e-5, err_msg=f"{what} {stage}")


@pytest.mark.slow
def test_grpo_on_fsdp_tensor_mesh_matches_single_device(runs):
    mesh, ref = runs["grpo_mesh"].check(), runs["grpo_ref"].check()
    assert "mesh (data=1, fsdp=4, tensor=2) over 8 device(s)" in mesh.log.read_text()
    rows = mesh.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 1, 2, 3]  # 4 SFT steps, 3 GRPO steps
    _assert_rows_match(rows, ref.rows()[:len(rows)], "grpo fsdp=4,tensor=2")
    _assert_stages_match(mesh.summary(), ref.summary(), ("start", "after SFT"), "grpo fsdp=4,tensor=2")
    assert (mesh.workdir / "export" / "model.safetensors").exists()


@pytest.mark.slow
def test_ppo_on_data_fsdp_mesh_matches_single_device(runs):
    mesh, ref = runs["ppo_mesh"].check(), runs["ppo_ref"].check()
    assert "mesh (data=2, fsdp=4, tensor=1) over 8 device(s)" in mesh.log.read_text()
    _assert_rows_match(mesh.rows(), ref.rows(), "ppo data=2,fsdp=4")
    got, want = mesh.summary(), ref.summary()
    _assert_stages_match(got, want, ("start", "after PPO"), "ppo data=2,fsdp=4")
    for k, v in want["reward_model_heldout"].items():
        np.testing.assert_allclose(got["reward_model_heldout"][k], v, rtol=1e-3, atol=1e-5, err_msg=k)


@pytest.mark.slow
def test_two_processes_match_one_and_write_metrics_once(runs):
    mp, ref = runs["grpo_2proc"].check(), runs["grpo_ref"].check()
    logs = {p.name: p.read_text() for p in mp.logs.glob("process_*.log")}
    assert sorted(logs) == ["process_0.log", "process_1.log"]
    assert "over 4 device(s) of 2 process(es)" in logs["process_1.log"]
    assert "| stage |" in logs["process_0.log"] and "| stage |" not in logs["process_1.log"]
    rows = mp.rows()  # one line per logged step: process 0 writes, process 1 does not
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 1, 2, 3]
    _assert_rows_match(rows, ref.rows()[:len(rows)], "grpo on 2 processes")
    _assert_stages_match(mp.summary(), ref.summary(), ("start", "after SFT"), "grpo on 2 processes")
    assert (mp.workdir / "grpo" / "3").is_dir()  # the checkpoint both processes wrote
    assert (mp.workdir / "export" / "model.safetensors").exists()  # gathered from both, written by process 0


@pytest.mark.slow
def test_mesh_checkpoint_resumes_on_another_mesh(runs):
    assert "grpo_resumed" in runs, "the (fsdp=4, tensor=2) run failed, see its test"
    resumed, ref = runs["grpo_resumed"].check(), runs["grpo_ref"].check()
    text = resumed.log.read_text()
    assert "mesh (data=2, fsdp=2, tensor=2)" in text
    assert "sft: resuming at step 4 of 4" in text and "grpo: resuming at step 3 of 5" in text
    assert "resuming with mesh: 'fsdp=4,tensor=2' -> 'data=2,fsdp=2,tensor=2'" in text  # an accepted change
    _assert_rows_match(resumed.rows(), ref.rows(), "resumed on data=2,fsdp=2,tensor=2")  # steps 1-3, then 4-5
    _assert_stages_match(resumed.summary(), ref.summary(), ("after GRPO",), "resumed")
