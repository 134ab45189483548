"""Never save a poisoned state, fall back from a corrupt checkpoint, cut the log back on resume.

In-process on a tiny regression loop: an update that blows the state up stops the phase
before the save, with the reason; a newest checkpoint that does not restore is moved aside
and the previous one resumed; `metrics.jsonl` and the TensorBoard events of an interrupted
and resumed run equal an uninterrupted run's. Through the command line on the tiny GRPO
config (one blown-up workdir shared, copied where a test changes it): the blow-up's exit
code, last line and kept checkpoint, a rerun with a sane learning rate, a corrupt newest
checkpoint, one without its manifest, and no checkpoint that restores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import cache_env, session_folder  # noqa: E402
from _toy_phase import ARRAYS, TX, toy_step  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.algorithms import common  # noqa: E402
from jaxrlhf.runs.checkpointing import Checkpointer  # noqa: E402
from jaxrlhf.runs.health import UnhealthyUpdateError  # noqa: E402
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, Preempted, run_phase  # noqa: E402
from jaxrlhf.runs.metrics import MetricsWriter, rows_before_resume  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_step = jax.jit(toy_step)


def _run(workdir, *, num_steps=6, should_stop=None, step_fn=_step, checkpoint_every=2, tensorboard=False):
    state = common.TrainState.create({"w": jnp.full(3, 0.5)}, TX)
    batches = ArrayBatches(ARRAYS, data.BatchIterator(40, 8, seed=3))
    writer = MetricsWriter(workdir, tensorboard=tensorboard)
    phase = PhaseConfig("phase", num_steps, log_every=1, checkpoint_every=checkpoint_every, progress=False,
                        max_param_norm_change=1.0)
    try:
        return run_phase(phase, workdir=workdir, state=state, step_fn=step_fn, batches=batches,
                         rng=jax.random.key(0), writer=writer, should_stop=should_stop, params_of=lambda s: s.params)
    finally:
        writer.close()


def _rows(workdir) -> list[dict]:
    """The logged metrics without wall-clock timings (which differ between runs)."""
    rows = map(json.loads, (Path(workdir) / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in row.items() if "/time/" not in k} for row in rows]


def _poison_at_3(poison):
    def step(state, batch, rng):
        state, metrics = _step(state, batch, rng)
        return (poison(state) if int(state.step) == 3 else state), metrics
    return step


POISONS = {
    "norm_jump": (lambda s: s.replace(params={"w": s.params["w"] * 1e3}),
                  r"the parameters. global norm went from .* above train.max_param_norm_change=1\).*; "
                  r"lower phase.optim.lr \(rerun with --resume_with_changes .*\), or raise "
                  r"train.max_param_norm_change"),
    "params_inf": (lambda s: s.replace(params={"w": s.params["w"].at[0].set(jnp.inf)}),
                   r"the parameters are not finite after the update \(global norm inf\)"),
    "opt_state_nan": (lambda s: s.replace(opt_state=jax.tree.map(lambda x: x * jnp.nan, s.opt_state)),
                      r"the optimizer state is not finite after the update"),
}


@pytest.mark.parametrize("poison", POISONS)
def test_an_unhealthy_update_stops_the_phase_before_its_state_is_saved(tmp_path, poison):
    """Step 3's metrics (computed before its update) are fine; the state it leaves is not:
    the phase stops at step 3 naming the reason, keeps step 2's checkpoint, logs no row 3."""
    fn, reason = POISONS[poison]
    with pytest.raises(UnhealthyUpdateError, match=r"^phase step 3: " + reason) as err:
        _run(tmp_path, step_fn=_poison_at_3(fn), checkpoint_every=1)
    assert "the checkpoint of step 2 (phase/2) is kept" in str(err.value)
    assert Checkpointer(tmp_path / "phase").latest_step() == 2
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]


def _largest_file(folder: Path) -> Path:
    return max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _truncate(step_dir: Path) -> None:
    """Cuts the largest data file of a checkpoint short, as a full disk or a bad copy does."""
    f = _largest_file(step_dir / "state")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _poison(step_dir: Path) -> None:
    """Replaces the checkpoint by one of a non-finite state (as written before states were checked)."""
    ckpt = Checkpointer(step_dir.parent)
    _, state, meta = ckpt.restore(common.TrainState.create({"w": jnp.zeros(3)}, TX), int(step_dir.name))
    ckpt.close()
    shutil.rmtree(step_dir)
    ckpt = Checkpointer(step_dir.parent)
    ckpt.save(int(step_dir.name), state.replace(params={"w": state.params["w"] * jnp.inf}), meta, force=True)
    ckpt.close()


@pytest.mark.parametrize("damage", [_truncate, _poison], ids=["truncated", "not_finite"])
def test_a_newest_checkpoint_that_does_not_restore_is_moved_aside(tmp_path, caplog, damage):
    """Checkpoints 2 and 4, the 4th damaged: the run warns, moves it to `4.corrupt-1` (which
    orbax then ignores), resumes from 2, writes 4 again and ends as an uninterrupted run."""
    full, _ = _run(tmp_path / "full")
    with pytest.raises(Preempted):
        _run(tmp_path / "run", should_stop=lambda step: step == 4)
    damage(tmp_path / "run" / "phase" / "4")
    with caplog.at_level(logging.WARNING, logger="jaxrlhf"):
        resumed, _ = _run(tmp_path / "run")
    assert any("phase/4 does not restore" in r.message and "moved to 4.corrupt-1, resuming from step 2" in r.message
               for r in caplog.records), caplog.text
    assert sorted(p.name for p in (tmp_path / "run" / "phase").iterdir()) == ["4", "4.corrupt-1", "6"]
    np.testing.assert_array_equal(resumed.params["w"], full.params["w"])
    assert _rows(tmp_path / "run") == _rows(tmp_path / "full")


def test_an_incomplete_newest_checkpoint_is_passed_over_before_orbax_reads_it(tmp_path, caplog, capfd, monkeypatch):
    """Step 4 without its `manifest.ocdbt`: the warning names the missing file, the run
    resumes from step 2, and orbax is never asked to read step 4 (a restore that fails
    part-way leaves reads in flight that print "Event loop is closed" tracebacks)."""
    import orbax.checkpoint as ocp

    with pytest.raises(Preempted):
        _run(tmp_path, should_stop=lambda step: step == 4)
    (tmp_path / "phase" / "4" / "state" / "manifest.ocdbt").unlink()
    asked = []
    for name in ("restore", "item_metadata"):
        original = getattr(ocp.CheckpointManager, name)
        monkeypatch.setattr(ocp.CheckpointManager, name,
                            lambda self, step, *a, _f=original, **k: asked.append(step) or _f(self, step, *a, **k))
    with caplog.at_level(logging.WARNING, logger="jaxrlhf"):
        _run(tmp_path)
    assert 4 not in asked and 2 in asked
    assert (f"checkpoint {tmp_path / 'phase' / '4'} does not restore (checkpoint {tmp_path / 'phase' / '4'} is "
            "incomplete: state/manifest.ocdbt is missing); moved to 4.corrupt-1, resuming from step 2") in caplog.text
    assert "Event loop is closed" not in capfd.readouterr().err


def test_rows_before_resume():
    """What an uninterrupted run had written when a phase runs again from its step s."""
    rows = [{"step": s, f"{p}/loss": 1.0} for p, n in (("sft", 4), ("grpo", 3)) for s in range(1, n + 1)]
    lines = [json.dumps(r) + "\n" for r in rows]
    assert rows_before_resume(lines, "grpo", 3) == 7  # nothing past the checkpoint
    assert rows_before_resume(lines, "grpo", 1) == 5  # grpo's steps 2, 3 go
    assert rows_before_resume(lines, "grpo", 0) == 4  # a phase started over: all its rows go
    assert rows_before_resume(lines, "sft", 2) == 2  # and a later phase's rows with them
    assert rows_before_resume(lines[:6] + ['{"step": 3, "grpo/lo'], "grpo", 3) == 6  # a row cut short by a kill


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars TensorBoard shows for an event folder: files in name order, and a purge
    marker (SessionLog START at step p) drops the events read so far at steps >= p."""
    from tensorboardX.proto import event_pb2

    seen: list[tuple[str, int, float]] = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):  # TFRecord: length (8 bytes), its CRC (4), the event, its CRC (4)
            (n,) = struct.unpack("<Q", raw[at:at + 8])
            event = event_pb2.Event.FromString(raw[at + 12:at + 12 + n])
            at += n + 16
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                seen = [e for e in seen if e[1] < event.step]
            for value in event.summary.value:
                seen.append((value.tag, event.step, value.simple_value))
    out: dict[str, list[tuple[int, float]]] = {}
    for tag, step, value in seen:
        out.setdefault(tag, []).append((step, value))
    return out


def test_a_resume_after_kill_minus_9_mid_save_cuts_the_log_back(tmp_path):
    """Stopped at step 3; then what a kill -9 while saving step 4 leaves: rows and events of
    steps 4-5 past the checkpoint, a row cut short, an orbax temporary folder. The resumed
    run's metrics.jsonl and TensorBoard scalars equal the uninterrupted run's."""
    _run(tmp_path / "full", tensorboard=True)
    run = tmp_path / "run"
    with pytest.raises(Preempted):
        _run(run, should_stop=lambda step: step == 3, tensorboard=True)
    from tensorboardX import SummaryWriter

    later = [line for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines(keepends=True)
             if json.loads(line)["step"] in (4, 5)]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(later) + '{"step": 6, "phase/lo')
    killed = SummaryWriter(str(run / "tensorboard" / "phase"), filename_suffix=f".{time.time_ns()}")
    for step in (4, 5):
        killed.add_scalar("phase/loss", 123.0, step)
    killed.close()
    (run / "phase" / "4.orbax-checkpoint-tmp").mkdir()
    _run(run, tensorboard=True)
    assert _rows(run) == _rows(tmp_path / "full")
    full, resumed = _events(tmp_path / "full" / "tensorboard" / "phase"), _events(run / "tensorboard" / "phase")
    assert [s for s, _ in resumed["phase/loss"]] == [1, 2, 3, 4, 5, 6]
    assert resumed["phase/loss"] == full["phase/loss"] and set(resumed) == set(full)


# ---- through the command line, on the tiny GRPO config --------------------------------------------------------


def _train(workdir: Path, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **cache_env(cache))
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_grpo.py:tiny",
           f"--workdir={workdir}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The session's compilation cache: the runs below share most of their programs."""
    return session_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def blown_up(tmp_path_factory, cache):
    """A tiny GRPO run at lr 1e6, a checkpoint every step: the warm-up's first update (lr 0)
    is saved as grpo/1, the second blows the parameters' norm up."""
    root = tmp_path_factory.mktemp("blown_up")
    proc = _train(root / "run", "--config.grpo.optim.lr=1e6", "--config.train.checkpoint_every=1", cache=cache)
    return root, proc


@pytest.fixture(scope="module")
def rerun(blown_up, cache):
    """The blown-up workdir run again with the config's own learning rate (a safe change)."""
    root, _ = blown_up
    shutil.copytree(root / "run", root / "rerun")
    return _train(root / "rerun", "--resume_with_changes", cache=cache)


def test_a_blown_up_update_stops_the_run_keeps_the_last_good_checkpoint_and_exports_nothing(blown_up):
    root, proc = blown_up
    assert proc.returncode != 0
    last = _last_line(proc)
    assert "grpo step 2: the parameters' global norm went from" in last, proc.stderr[-3000:]
    assert "(grpo/1) is kept; lower grpo.optim.lr (rerun with --resume_with_changes" in last
    run = root / "run"
    assert not (run / "export").exists() and not (run / "summary.json").exists()
    assert sorted(p.name for p in (run / "grpo").iterdir()) == ["1"]
    assert [r["step"] for r in _rows(run) if "grpo/loss" in r] == [1]  # no row for the blown-up step


@pytest.mark.heavy  # a further case: the stop itself is tested quick
def test_a_rerun_with_a_sane_lr_resumes_from_the_last_good_step(rerun):
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "grpo: resuming at step 1 of 3" in rerun.stderr


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_step(blown_up, rerun, cache):
    """A finished run whose grpo/3 lost half a data file resumes from grpo/2, says so, and
    ends with the same log as before."""
    root, _ = blown_up
    shutil.copytree(root / "rerun", root / "corrupt")
    _truncate(root / "corrupt" / "grpo" / "3")
    shutil.rmtree(root / "corrupt" / "export")
    proc = _train(root / "corrupt", cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo/3 does not restore" in proc.stderr and "moved to 3.corrupt-1, resuming from step 2" in proc.stderr
    assert "Event loop is closed" not in proc.stderr and "Task exception was never retrieved" not in proc.stderr
    assert (root / "corrupt" / "export").is_dir()
    assert sorted(p.name for p in (root / "corrupt" / "grpo").iterdir()) == ["2", "3", "3.corrupt-1"]
    assert _rows(root / "corrupt") == _rows(root / "rerun")


def test_a_newest_checkpoint_without_its_manifest_falls_back_with_one_warning(blown_up, rerun, cache):
    """grpo/3 without `state/manifest.ocdbt`: stderr has the warning naming the missing file
    and none of the tracebacks of a failed orbax restore's orphaned reads."""
    root, _ = blown_up
    shutil.copytree(root / "rerun", root / "no_manifest")
    (root / "no_manifest" / "grpo" / "3" / "state" / "manifest.ocdbt").unlink()
    shutil.rmtree(root / "no_manifest" / "export")
    proc = _train(root / "no_manifest", cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo/3 is incomplete: state/manifest.ocdbt is missing); moved to 3.corrupt-1, resuming from step 2" \
        in proc.stderr
    for noise in ("Event loop is closed", "Task exception was never retrieved", "Traceback"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_no_checkpoint_that_restores_is_the_last_line_and_moves_nothing(blown_up, rerun, cache):
    root, _ = blown_up
    shutil.copytree(root / "rerun", root / "lost")
    shutil.rmtree(root / "lost" / "export")
    for step in ("2", "3"):
        _truncate(root / "lost" / "grpo" / step)
    proc = _train(root / "lost", cache=cache)
    assert proc.returncode != 0
    last = _last_line(proc)
    assert f"no checkpoint in {root / 'lost' / 'grpo'} restores (steps 3, 2)" in last, proc.stderr[-3000:]
    assert f"move {root / 'lost' / 'grpo'} aside to start this phase over" in last
    assert sorted(p.name for p in (root / "lost" / "grpo").iterdir()) == ["2", "3"]
    assert not (root / "lost" / "export").exists()
