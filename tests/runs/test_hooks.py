"""The train loop's hooks (`runs.hooks`): a user's hook by import path sees every step, each
evaluation and each save at its step, through `run_phase` and through the command line
(`--config.train.hooks`); time-based checkpoints (`checkpoint_every_s`) on an injected
clock; what a user hook raises, or a bad `train.hooks`, is an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _user_hook  # noqa: E402
import _xla  # noqa: E402
from _toy_phase import ARRAYS, TX, toy_step  # noqa: E402

from jaxrlhf import data  # noqa: E402
from jaxrlhf.algorithms import common  # noqa: E402
from jaxrlhf.runs import config_base, validation  # noqa: E402
from jaxrlhf.runs.checkpointing import Checkpointer  # noqa: E402
from jaxrlhf.runs.hooks import Hook, HookError, check_train, load_hooks  # noqa: E402
from jaxrlhf.runs.loop import ArrayBatches, PhaseConfig, Preempted, run_phase  # noqa: E402
from jaxrlhf.runs.metrics import MetricsWriter  # noqa: E402

REPO = HERE.parents[1]
_step = jax.jit(toy_step)


@pytest.fixture(autouse=True)
def _fresh_events():
    _user_hook.EVENTS.clear()
    yield
    _user_hook.EVENTS.clear()


def _run(workdir, num_steps=7, *, hooks=(), spec="", step_fn=_step, eval_every=3, checkpoint_every=2,
         checkpoint_every_s=None, clock=None, should_stop=None):
    state = common.TrainState.create({"w": jnp.zeros(3)}, TX)
    batches = ArrayBatches(ARRAYS, data.BatchIterator(40, 8, seed=3))
    writer = MetricsWriter(workdir, tensorboard=False)
    phase = PhaseConfig("phase", num_steps, log_every=1, eval_every=eval_every, checkpoint_every=checkpoint_every,
                        keep_checkpoints=20, progress=False, checkpoint_every_s=checkpoint_every_s,
                        hooks=load_hooks(spec))
    try:
        return run_phase(phase, workdir=workdir, state=state, step_fn=step_fn, batches=batches, rng=jax.random.key(0),
                         writer=writer, eval_fn=lambda s: {"w0": s.params["w"][0]}, hooks=hooks,
                         should_stop=should_stop, **({"clock": clock} if clock else {}))
    finally:
        writer.close()


def _expected(phase, steps, evals, saves, start=0, end=None):
    """The events of `Recorder` over a phase: a step's on_eval, its on_step (whose row holds
    the evaluation), then its on_save."""
    out = [["start", phase, start]]
    for step in range(start + 1, steps + 1):
        if step in evals:
            out.append(["eval", phase, step])
        out.append(["step", phase, step, step in evals])
        if step in saves:
            out.append(["save", phase, step])
    return out + [["end", phase, end]]


@pytest.mark.parametrize("spec", ["_user_hook:Recorder", "_user_hook:make_recorder"], ids=["class", "factory"])
def test_a_hook_by_import_path_sees_every_step_each_evaluation_and_each_save(tmp_path, spec):
    _run(tmp_path, spec=spec)
    assert _user_hook.EVENTS == _expected("phase", 7, evals={3, 6}, saves={2, 4, 6, 7})
    assert sorted(int(p.name) for p in (tmp_path / "phase").iterdir()) == [2, 4, 6, 7]


def test_hooks_given_as_objects_come_after_the_configs_and_keep_state_in_the_checkpoints(tmp_path):
    """A hook's `checkpoint_meta` is saved with the step it has seen (the user's hooks come
    before the save), so a resumed run's hook counts on as an uninterrupted one's."""
    class Last(Hook):
        def on_step(self, ctx, step, state, metrics):
            _user_hook.record("last", step)

    with pytest.raises(Preempted):
        _run(tmp_path, spec="_user_hook:Counter", hooks=(Last(),), should_stop=lambda step: step == 3)
    assert _user_hook.EVENTS == [["last", 1], ["last", 2], ["last", 3], ["count", 3]]
    _user_hook.EVENTS.clear()
    _run(tmp_path, spec="_user_hook:Counter")  # resumes at step 3: the count from the checkpoint
    assert _user_hook.EVENTS == [["count", 7]]


def test_checkpoints_every_n_seconds_on_the_clock(tmp_path):
    """Each step takes 25 s of a fake clock: with checkpoint_every_s=60 the saves come at
    steps 3 (75 s after the start) and 6 (75 s after that), and at the end (7)."""
    now = [1000.0]

    def slow_step(state, batch, rng):
        now[0] += 25.0
        return _step(state, batch, rng)

    _run(tmp_path, spec="_user_hook:Recorder", step_fn=slow_step, eval_every=0, checkpoint_every=100,
         checkpoint_every_s=60, clock=lambda: now[0])
    assert [e[2] for e in _user_hook.EVENTS if e[0] == "save"] == [3, 6, 7]
    assert sorted(int(p.name) for p in (tmp_path / "phase").iterdir()) == [3, 6, 7]


def test_step_and_time_based_saves_together_restart_the_clock(tmp_path):
    now = [0.0]

    def slow_step(state, batch, rng):
        now[0] += 25.0
        return _step(state, batch, rng)

    # steps at 25 s each: step 2 saves by count (clock restarts at 50 s), 4 by count (100 s),
    # 5 would be 25 s after 4: none; 6 by count; 7 the end
    _run(tmp_path, spec="_user_hook:Recorder", step_fn=slow_step, eval_every=0, checkpoint_every=2,
         checkpoint_every_s=40, clock=lambda: now[0])
    assert [e[2] for e in _user_hook.EVENTS if e[0] == "save"] == [2, 4, 6, 7]


def test_a_hook_that_raises_stops_the_run_with_an_error_naming_it(tmp_path):
    with pytest.raises(HookError, match=r"^train\.hooks: _user_hook:Raising\.on_step raised RuntimeError: boom at "
                                        r"step 2$"):
        _run(tmp_path, spec="_user_hook:Recorder,_user_hook:Raising")
    assert _user_hook.EVENTS[-1] == ["end", "phase", "HookError"]  # every hook's on_end saw it
    assert Checkpointer(tmp_path / "phase").latest_step() is None  # step 2 was not saved: the hook came first


def test_sys_exit_in_a_hook_is_an_error_naming_it(tmp_path):
    with pytest.raises(HookError, match=r"^train\.hooks: _user_hook:Exiting\.on_save called sys\.exit\(3\): a hook "
                                        "must not end the process"):
        _run(tmp_path, spec="_user_hook:Exiting")


@pytest.mark.parametrize("spec, message", [
    ("_no_such_module:Hook", "train.hooks='_no_such_module:Hook': module '_no_such_module' of "
                             "'_no_such_module:Hook' does not import (ModuleNotFoundError: No module named "
                             "'_no_such_module'); is its folder on PYTHONPATH?"),
    ("_user_hook:Recorder,_user_hook:Missing", "train.hooks='_user_hook:Recorder,_user_hook:Missing': module "
                                               "'_user_hook' has no attribute 'Missing' (entry "
                                               "'_user_hook:Missing')"),
    ("_user_hook.Recorder", "train.hooks='_user_hook.Recorder': '_user_hook.Recorder' is not an import path "
                            "'package.module:Hook'"),
    ("_user_hook:NOT_A_HOOK", "train.hooks='_user_hook:NOT_A_HOOK': '_user_hook:NOT_A_HOOK' is a int, not a hook "
                              "class, factory or object"),
    ("_user_hook:NeedsArguments", "train.hooks='_user_hook:NeedsArguments': calling _user_hook:NeedsArguments() "
                                  "raised TypeError"),
], ids=["module", "attribute", "no_colon", "not_a_hook", "arguments"])
def test_a_bad_spec_is_a_one_line_error_naming_the_entry(spec, message):
    with pytest.raises(ValueError) as error:
        load_hooks(spec)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def _tiny_sft(**sections):
    import importlib.util

    spec = importlib.util.spec_from_file_location("addition_sft", REPO / "configs" / "addition_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        for name, section in sections.items():
            del config[name]
            config[name] = section
    return config


def test_the_train_keys_are_checked_before_any_work():
    train = config_base.train()
    assert train.hooks is None and train.checkpoint_every_s is None
    check_train(train)
    with pytest.raises(ValueError, match=r"^train\.hooks='_no_such_module:Hook': module"):
        check_train(config_base.train(hooks="_no_such_module:Hook"))
    with pytest.raises(ValueError, match=r"^train\.checkpoint_every_s=-1\.0 is impossible: it must be > 0"):
        validation.check_values(_tiny_sft(train=config_base.train(checkpoint_every_s=-1.0)))
    assert load_hooks(None) == () and load_hooks("") == () and load_hooks(" , ") == ()


def _train(*args, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    environment.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla.flags(), PYTHONPATH=os.pathsep.join((str(REPO), str(HERE))),
                       **env)
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_sft.py:tiny",
                           *args], env=environment, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_hook_on_the_command_line(tmp_path):
    """The tiny SFT run (6 steps, an evaluation and a checkpoint every 3) with
    `--config.train.hooks`: the hook, made once for the phase, sees all of it."""
    events = tmp_path / "events.jsonl"
    proc = _train(f"--workdir={tmp_path / 'run'}", "--config.train.hooks=_user_hook:Recorder",
                  USER_HOOK_LOG=str(events))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    assert seen == _expected("sft", 6, evals={3, 6}, saves={3, 6})


def test_a_bad_hook_on_the_command_line_is_refused_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    proc = _train(f"--workdir={workdir}", "--config.train.hooks=_user_hook:Missing")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(
        "error: train.hooks='_user_hook:Missing': module '_user_hook' has no attribute 'Missing'"), proc.stderr[-3000:]
    assert not workdir.exists()
