"""An algorithm defined entirely in this file — its loss, its config dataclass, its phase and
its registration — runs through `python -m jaxrlhf.train` touching no library file: this
file is also the config file (`--config=tests/runs/test_custom_algorithm.py:tiny`).

Focal SFT: the masked mean over response tokens of `(1 − p)^γ · NLL`, `p = exp(−NLL)` the
token's probability (the weight held constant): easy tokens count less (γ = 0 is SFT).

Checked through the command line: the run trains (its NLL falls), checkpoints, a SIGTERM
during a save stops it with status 0 and the rerun resumes to the same metrics as an
uninterrupted run, its options are `--config.focal_sft.*` with the bounds of their fields,
and the health monitor stops a run whose loss is not finite before anything is saved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxrlhf import ops, options
from jaxrlhf.algorithms import common, sft
from jaxrlhf.algorithms.common import OptimConfig
from jaxrlhf.monitor import HealthMonitor, MonitorConfig
from jaxrlhf.options import check, option, section
from jaxrlhf.runs import builtin, phases, registry

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


# ----------------------------------------------------------------------------- the algorithm


@dataclasses.dataclass(frozen=True)
class FocalConfig:
    """Focal SFT's own option."""

    gamma: float = option(2.0, "γ of the weight (1 − p)^γ; 0 is plain SFT", min=0)

    def __post_init__(self):
        check(self)


@dataclasses.dataclass(frozen=True)
class FocalRun:
    """The phase's run options (what `phases.update_phase` reads)."""

    steps: int = option(6, "steps", min=1)
    batch_size: int = option(16, "examples per step", min=1)
    seed: int = option(0, "the batch order's seed")
    optim: OptimConfig = option(doc="the optimizer", factory=lambda: OptimConfig(lr=3e-3))


def focal_loss(params, batch, *, model, cfg: FocalConfig, prompt_len: int):
    """`(loss, metrics)`: masked mean of `stop_gradient((1 − p)^γ) · NLL` over response tokens."""
    nll_BxT, _, mask_BxT = sft.token_nll(model, params, batch, prompt_len)
    weight_BxT = jax.lax.stop_gradient((1.0 - jnp.exp(-nll_BxT)) ** cfg.gamma)
    loss = ops.masked_mean(weight_BxT * nll_BxT, mask_BxT)
    return loss, dict(nll=ops.masked_mean(jax.lax.stop_gradient(nll_BxT), mask_BxT))


def make_step(model, tx, cfg: FocalConfig, prompt_len: int):
    def step(state: common.TrainState, batch, rng):
        (loss, metrics), grads = jax.value_and_grad(focal_loss, has_aux=True)(
            state.params, {k: batch[k] for k in sft.BATCH_KEYS}, model=model, cfg=cfg, prompt_len=prompt_len)
        new_state, finite = common.apply_if_finite(state, grads, tx, loss)
        return new_state, dict(loss=loss, grad_norm=optax.tree.norm(grads), finite=finite, **metrics)
    return step


def run_focal(run: registry.Run) -> None:
    """The phase: the task's SFT arrays through `phases.update_phase`, with the health monitor."""
    section_ = run.config.focal_sft
    cfg = options.build(FocalConfig, section_, "focal_sft.")
    run.params, _ = phases.update_phase(
        "focal_sft", section_, run.config.train, arrays={k: run.task.sft[k] for k in sft.BATCH_KEYS},
        make_step=lambda model, tx: make_step(model, tx, cfg, run.task.prompt_len), show=("loss", "nll"),
        monitor=HealthMonitor(MonitorConfig()), **builtin.policy_args(run, FOCAL))


FOCAL = registry.Phase("focal_sft", (FocalRun, FocalConfig), run_focal, stream=11,
                       check_shapes=builtin.batch_shapes("focal_sft"),
                       build=lambda section_, task, monitor: options.build(FocalConfig, section_, "focal_sft."))
registry.register(FOCAL, registry.Algorithm("focal_sft", registry.policy_plan("focal_sft")))


def get_config(arg=None):
    """The tiny addition task's SFT config, its algorithm focal SFT (no warm start)."""
    spec = importlib.util.spec_from_file_location("addition_sft", REPO / "configs" / "addition_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny" if arg == "tiny" else arg)
    with c.unlocked():
        c.algorithm = "focal_sft"
        c.sft.steps = 0
        c.focal_sft = section(FocalRun, FocalConfig)
        c.train.update(eval_every=0, checkpoint_every=2)
    return c


# ----------------------------------------------------------------------------- the tests

sys.path.insert(0, str(HERE))
from _compile_cache import cache_env, session_folder  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return session_folder(tmp_path_factory)


def _train(workdir: Path, *args: str, cache: Path, signal_at: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXRLHF_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **cache_env(cache))
    if signal_at:
        env["JAXRLHF_TEST_SIGNAL_AT"] = signal_at
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={__file__}:tiny", f"--workdir={workdir}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _metrics(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "/time/" not in k} for row in rows]


@pytest.mark.heavy  # end to end through the command line (the registry is unit-tested in this file)
def test_a_registered_algorithm_trains_checkpoints_and_resumes_after_sigterm(tmp_path, cache):
    full = tmp_path / "full"
    proc = _train(full, cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(full)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["focal_sft/nll"] < rows[0]["focal_sft/nll"]  # it learns
    assert sorted(p.name for p in (full / "focal_sft").iterdir() if p.name.isdigit()) == ["4", "6"]
    assert "| after FOCAL_SFT |" in proc.stdout and (full / "export" / "config.json").exists()

    resumed = tmp_path / "resumed"
    stopped = _train(resumed, cache=cache, signal_at="save:SIGTERM")  # during the save of step 2
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM: the checkpoint focal_sft/3")
    again = _train(resumed, cache=cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "focal_sft: resuming at step 3 of 6" in again.stderr
    assert _metrics(resumed) == rows  # resume = uninterrupted


def test_its_options_are_config_keys_with_their_fields_bounds(tmp_path, cache):
    proc = _train(tmp_path / "w", "--config.focal_sft.gamma=-1", cache=cache)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: focal_sft.gamma=-1.0 is impossible: it must be >= 0")
    assert not (tmp_path / "w").exists()  # refused before the workdir was claimed


def test_the_health_monitor_stops_a_non_finite_loss_before_it_is_saved(tmp_path, cache):
    """An absurd learning rate (the update guard off) makes the second step's loss overflow:
    the monitor stops the run there, keeping no checkpoint of a poisoned state."""
    workdir = tmp_path / "w"
    proc = _train(workdir, "--config.focal_sft.optim.lr=1e30", "--config.focal_sft.optim.max_grad_norm=None",
                  "--config.train.max_param_norm_change=None", cache=cache)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "non-finite training metrics at step" in proc.stderr.strip().splitlines()[-1]
    assert not [p for p in (workdir / "focal_sft").iterdir() if p.name.isdigit()]
