"""The launchers' --dry-run prints the command each one would start (nothing is run)."""

from __future__ import annotations

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["python", "-m", "jaxrlhf.train", "--config=configs/addition_grpo.py"]


def dry_run(script, *args, env=None):
    out = subprocess.run(["bash", os.path.join(REPO, "launch", script), *args], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_local_multiprocess_dry_run():
    lines = dry_run("local_multiprocess.sh", "-n", "3", "-d", "2", "--port", "4321", "--dry-run", "--", *TRAIN)
    lines = lines.strip().splitlines()
    assert len(lines) == 4 and lines[-1] == "wait"
    for i, line in enumerate(lines[:3]):
        for part in ("JAX_PLATFORMS=cpu", "--xla_force_host_platform_device_count=2",
                     "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo", "JAXRLHF_COORDINATOR_ADDRESS=127.0.0.1:4321",
                     "JAXRLHF_NUM_PROCESSES=3", f"JAXRLHF_PROCESS_ID={i}", " ".join(TRAIN)):
            assert part in line, (part, line)


def test_tpu_pod_dry_run():
    out = dry_run("tpu_pod.sh", "--tpu", "pod-1", "--zone", "us-central2-b", "--dry-run", "--", *TRAIN)
    assert out.startswith("gcloud compute tpus tpu-vm ssh pod-1 --zone=us-central2-b --worker=all --command=")
    assert "JAXRLHF_DISTRIBUTED=auto" in out and "jaxrlhf.train" in out


@pytest.mark.parametrize("per, needle", [("gpu", "srun --kill-on-bad-exit=1"), ("node", "JAXRLHF_LOCAL_DEVICE_IDS")])
def test_slurm_dry_run(per, needle):
    out = dry_run("slurm_gpu.sbatch", "--dry-run", *TRAIN, env={"PER": per})
    assert needle in out and "JAXRLHF_DISTRIBUTED=auto" in out and "--config=configs/addition_grpo.py" in out


def test_missing_command_is_an_error():
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no command" in out.stderr
