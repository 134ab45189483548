"""Every way a run stops ends with one last line, the right status, and a workdir a rerun
resumes from (`jaxrlhf.exits`, `jaxrlhf.cli.run_main`).

Through the command line on the tiny GRPO config (`--config.train.eval_every=0`), the
signals sent by the test hook `JAXRLHF_TEST_SIGNAL_AT` at named moments:

- SIGTERM during a checkpoint save, between the phases, during the final evaluation and
  during the export, each run the rerun of the one before (one workdir): status 0, a last
  line naming the checkpoints kept, no temporary folder, and a last rerun that finishes
  (and removes the temporary folders an export killed outright left);
- Ctrl-C during a save: status 130 within seconds of the signal (no wait on orbax's
  threads), the checkpoint saved before it kept;
- a reward function that calls `sys.exit`: status 1 and an error naming it; Ctrl-C inside
  one (in its worker process): status 130, naming it; one that hangs: status 1 at its
  `reward.timeout`, naming it, its worker gone;
- a full disk: a 20 MB tmpfs mounted as the workdir's disk and filled to 400 kB of room
  (as root), or where mounting fails the same failure injected by `_full_disk.py`: the
  error line says no space is left, which checkpoint is intact, and a rerun after freeing
  space finishes.

Each run reads its programs from the session's compilation cache (a few seconds each).
The handlers themselves (a second Ctrl-C, a `sys.exit` elsewhere, the hook's counting)
run in small processes that import no JAX.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import cache_env, session_folder  # noqa: E402

from jaxrlhf import data, exits, rewards  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TINY = [f"--config={REPO}/configs/addition_grpo.py:tiny", "--config.train.eval_every=0"]

REWARDS = '''
import multiprocessing, os, signal, time

def bye(completions, **kwargs):
    raise SystemExit(3)

def interrupted(completions, **kwargs):
    # Ctrl-C while the function runs: the terminal sends it to the run (and to the worker
    # process the function runs in, which ignores it)
    os.kill(os.getppid() if multiprocessing.parent_process() else os.getpid(), signal.SIGINT)
    time.sleep(30)
    return [0.0] * len(completions)
'''
HUNG = '''
import multiprocessing, os, time

if multiprocessing.parent_process() is not None:  # in the worker process: its pid, as its first call starts
    with open(os.path.join(os.path.dirname(__file__), "worker.pid"), "w") as f:
        f.write(str(os.getpid()))

def hang(completions, **kwargs):
    time.sleep(3600)
'''


def _environment(**env) -> dict:
    """This environment without jaxrlhf's own variables (a developer's JAXRLHF_TRACEBACK=1
    would change the last lines), plus `env`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("JAXRLHF_")}, **env}


def _train(workdir: Path, *args: str, cache: Path, signal_at: str = "", pythonpath: str = "",
           script: list | None = None) -> subprocess.CompletedProcess:
    env = _environment()
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), pythonpath) if p),
               **cache_env(cache))
    if signal_at:
        env[exits.TEST_SIGNAL_ENV] = signal_at
    cmd = [sys.executable, *(script or ["-m", "jaxrlhf.train"]), *TINY, f"--workdir={workdir}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines, proc.stdout
    return lines[-1]


def _temporary(workdir: Path) -> list[str]:
    """Every temporary folder or file left in `workdir` (orbax's, the export's), and its lock."""
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")
                  if ".tmp" in p.name or ".old-" in p.name or p.name == "run.lock")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return session_folder(tmp_path_factory)


# ----------------------------------------------------------------------------- SIGTERM at each moment

CHAIN = ("save:SIGTERM", "between_phases:SIGTERM", "eval#3:SIGTERM", "export:SIGTERM", "")


@pytest.fixture(scope="module")
def chain(tmp_path_factory, cache):
    """One workdir, run once per entry of CHAIN, each the rerun of the one before: `{signal_at:
    (process, temporary folders left, the sorted names in the workdir and its phase folders)}`.
    Before the last run, the folders an export killed by SIGKILL leaves are put there."""
    workdir = tmp_path_factory.mktemp("chain") / "run"
    out = {}
    for spec in CHAIN:
        if not spec:
            (workdir / ".export.tmp-killed").mkdir()
            (workdir / ".export.old-killed").mkdir()
        proc = _train(workdir, cache=cache, signal_at=spec)
        names = {p.name: sorted(q.name for q in p.iterdir()) for p in workdir.iterdir() if p.is_dir()}
        out[spec] = proc, _temporary(workdir), names
    return workdir, out


@pytest.mark.parametrize("spec, kept, resumed", [
    ("save:SIGTERM", "the checkpoint sft/3 in {w} is", None),  # sft/2 saved, then the flag: step 3, saved
    ("between_phases:SIGTERM", "the checkpoint sft/4 in {w} is", "sft: resuming at step 3 of 4"),
    ("eval#3:SIGTERM", "the checkpoints sft/4, grpo/3 in {w} are", "sft: resuming at step 4 of 4"),  # the final one
    ("export:SIGTERM", "the checkpoints sft/4, grpo/3 in {w} are", "grpo: resuming at step 3 of 3"),
], ids=["save", "between_phases", "final_eval", "export"])
def test_sigterm_stops_cleanly_with_what_was_kept(chain, spec, kept, resumed):
    workdir, runs = chain
    proc, temporary, names = runs[spec]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _last_line(proc) == f"stopped by SIGTERM: {kept.format(w=workdir)} kept; rerun the same command to resume"
    assert temporary == []  # no temporary folder, the lock released
    assert "export" not in names
    if resumed:
        assert resumed in proc.stderr


def test_the_run_after_the_signals_resumes_finishes_and_removes_a_killed_exports_folders(chain):
    workdir, runs = chain
    proc, temporary, names = runs[""]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpo: resuming at step 3 of 3" in proc.stderr and "total time" in proc.stdout
    assert temporary == []
    assert "config.json" in names["export"] and (workdir / "summary.json").exists()
    assert names["sft"] == ["3", "4"] and names["grpo"] == ["2", "3"]


# ----------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_during_a_save_ends_within_seconds_keeping_the_checkpoint(tmp_path, cache):
    workdir = tmp_path / "run"
    proc = _train(workdir, cache=cache, signal_at="save:SIGINT")
    ended = time.time()
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert _last_line(proc) == (f"error: interrupted (Ctrl-C): the checkpoint sft/2 in {workdir} is kept; rerun the "
                                "same command to resume")
    hook = next(line for line in proc.stderr.splitlines() if "test hook" in line)
    sent = datetime.datetime.strptime(hook[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert ended - sent < 10  # the save in flight finished, no wait on orbax's threads at exit
    assert sorted(p.name for p in (workdir / "sft").iterdir()) == ["2"] and _temporary(workdir) == []


# ----------------------------------------------------------------------------- reward functions

@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "exiting_rewards.py").write_text(REWARDS)
    return str(folder)


def test_a_reward_function_that_calls_sys_exit_is_an_error_naming_it(tmp_path, cache, reward_module):
    workdir = tmp_path / "run"
    proc = _train(workdir, "--config.sft.steps=0", "--config.reward.fns=exiting_rewards:bye", cache=cache,
                  pythonpath=reward_module)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _last_line(proc) == ("error: reward function exiting_rewards:bye called sys.exit(3): a reward function "
                                f"returns its scores and must not end the process (full traceback in "
                                f"{workdir}/train.log)")
    assert "RewardFunctionError" in (workdir / "train.log").read_text()


def test_ctrl_c_inside_a_reward_function_names_it(tmp_path, cache, reward_module):
    workdir = tmp_path / "run"
    proc = _train(workdir, "--config.sft.steps=0", "--config.reward.fns=exiting_rewards:interrupted", cache=cache,
                  pythonpath=reward_module)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert _last_line(proc) == ("error: interrupted (Ctrl-C) while running reward function exiting_rewards:interrupted:"
                                f" no checkpoint was written yet in {workdir}; rerun the same command to start again")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_a_hung_reward_function_stops_the_run_at_its_timeout_naming_it(tmp_path, cache):
    """`time.sleep(3600)` under `reward.timeout=3`: status 1 with the function and the
    timeout named, within timeout + 10 s of the first call (the worker writes its pid as
    that call starts, after the compilation), and the worker is not left running."""
    folder = tmp_path / "hung"
    folder.mkdir()
    (folder / "hung_rewards.py").write_text(HUNG)
    workdir = tmp_path / "run"
    proc = _train(workdir, "--config.sft.steps=0", "--config.reward.fns=hung_rewards:hang",
                  "--config.reward.timeout=3", cache=cache, pythonpath=str(folder))
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _last_line(proc).startswith("error: reward function hung_rewards:hang did not return within 3 s "
                                       "(reward.timeout=3) on "), _last_line(proc)
    progress = re.findall(r"reward function hung_rewards:hang has run ([\d.]+) s on \d+ completions \(timeout 3 s\)",
                          proc.stderr)
    assert 2 <= len(progress) <= 3 and 0.7 <= float(progress[0]) < 1.5, progress  # every timeout / 4: 0.75, 1.5, ...
    pid_file = folder / "worker.pid"
    assert ended - pid_file.stat().st_mtime < 3 + 10
    pid = int(pid_file.read_text())
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:  # reparented to init once the run is gone
        time.sleep(0.1)
    assert not _alive(pid)


def test_the_reward_wrapper_in_process():
    """`Reward.host_scores` turns a `sys.exit` into `RewardFunctionError` and names the
    function a Ctrl-C interrupted; an ordinary exception is reported as before."""
    tok = data.CharTokenizer()
    ids = np.asarray([[5, 6, tok.eos_id]])
    inputs = rewards.RewardInput(ids, np.ones_like(ids), ids, np.ones_like(ids), ids, np.ones_like(ids))

    def leaves(prompts, completions, **kwargs):
        raise SystemExit("bye")

    def interrupted(prompts, responses, extras):
        raise KeyboardInterrupt

    with pytest.raises(rewards.RewardFunctionError, match=r"reward function \S*test_exits:\S*leaves called "
                                                          r"sys.exit\('bye'\)"):
        rewards.trl_reward(leaves, tok).host_scores(inputs, {})
    with pytest.raises(KeyboardInterrupt, match=r"while running reward function \S*test_exits:\S*interrupted$"):
        rewards.host_reward(interrupted, tok).host_scores(inputs, {})
    with pytest.raises(RuntimeError, match="reward 'broken' raised ZeroDivisionError"):
        rewards.host_reward(lambda p, r, e: 1 / 0, tok, name="broken").host_scores(inputs, {})


# ----------------------------------------------------------------------------- a full disk

def _mount_tmpfs(folder: Path) -> bool:
    """Mount a 20 MB tmpfs at `folder`; False where that is not allowed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture
def full_disk(tmp_path):
    """(the folder for a workdir on a full disk, a function that frees the space, the way it
    is full: "tmpfs" or "injected"). The tmpfs is unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount_tmpfs(disk)
    try:
        if not mounted:
            yield disk, lambda: None, "injected"
            return
        filler = disk / "filler"
        stat = os.statvfs(disk)
        room = stat.f_bavail * stat.f_frsize - 400 * 1024  # left: 400 kB, sft/2 fits (250 kB), sft/4 does not
        with open(filler, "wb") as f:
            for _ in range(room // (1 << 20)):
                f.write(bytes(1 << 20))
            f.write(bytes(room % (1 << 20)))
        yield disk, filler.unlink, "tmpfs"
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_named_with_the_checkpoint_that_is_intact(full_disk, cache, record_property):
    disk, free_space, how = full_disk
    record_property("full_disk", how)
    print(f"full disk: {'a 20 MB tmpfs, filled' if how == 'tmpfs' else 'ENOSPC injected by _full_disk.py'}")
    workdir = disk / "run"
    script = None if how == "tmpfs" else [str(HERE / "_full_disk.py")]
    proc = _train(workdir, cache=cache, script=script)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last_line(proc)
    assert last.startswith(f"error: no space left on device writing {workdir}/sft: the checkpoint sft/2 in {workdir} "
                           "is intact; free some space and rerun the same command to resume ("), (how, last)
    assert f"the traceback could not be written to {workdir}/train.log" in last or "full traceback in" in last
    assert "Logging error" not in proc.stderr
    free_space()
    rerun = _train(workdir, cache=cache)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "sft: resuming at step 2 of 4" in rerun.stderr and (workdir / "export").is_dir()
    assert _temporary(workdir) == []  # the unfinished sft/4 of the full disk removed


# ----------------------------------------------------------------------------- the handlers alone

def _python(code: str, **env) -> tuple[subprocess.CompletedProcess, float]:
    env = _environment(PYTHONPATH=str(REPO), **env)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, time.perf_counter() - start


def test_a_second_ctrl_c_ends_the_process_at_once():
    proc, seconds = _python("""
        import signal, time
        from jaxrlhf import cli, exits

        def main(argv):
            exits.install()
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:  # a clean-up that hangs
                signal.raise_signal(signal.SIGINT)
                time.sleep(30)

        cli.run_main(main, [])
    """)
    assert proc.returncode == 130 and seconds < 20, proc.stderr
    assert _last_line(proc) == "error: interrupted twice (Ctrl-C): stopped at once, without cleaning up"


def test_a_ctrl_c_that_code_under_the_run_swallows_still_ends_it_with_130():
    """A KeyboardInterrupt raised where Python only prints it (a `__del__`, a callback of
    orbax's save) or caught by library code: the run still stops with status 130, at the
    next step of a loop (`exits.raise_if_interrupted`) or, at the latest, before success."""
    proc, seconds = _python("""
        import signal
        from jaxrlhf import cli, exits

        def main(argv):
            exits.install()
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:  # swallowed, as a destructor or a callback would
                pass
            for step in range(3):
                exits.raise_if_interrupted()  # the step loop's check
                print("step", step, flush=True)

        cli.run_main(main, [])
    """)
    assert proc.returncode == 130 and "step" not in proc.stdout, (proc.stdout, proc.stderr)
    assert _last_line(proc).startswith("error: interrupted (Ctrl-C): ")
    proc, _ = _python("""
        import signal
        from jaxrlhf import cli, exits

        def main(argv):
            exits.install()
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass  # and nothing checks again: run_main does before it reports success

        cli.run_main(main, [])
    """)
    assert proc.returncode == 130, proc.stderr
    assert _last_line(proc).startswith("error: interrupted (Ctrl-C): ")


def test_sys_exit_in_code_the_run_calls_is_an_error_naming_where():
    proc, _ = _python("""
        import sys
        from jaxrlhf import cli

        def leave(argv):
            sys.exit(3)

        cli.run_main(leave, [])
    """)
    assert proc.returncode == 1, proc.stderr
    assert _last_line(proc) == ("error: sys.exit(3) was called in <string>:6 (leave): the run stopped there, "
                                "unfinished (set JAXRLHF_TRACEBACK=1 for the full traceback)")


def test_the_signal_hook_is_inert_unless_set_and_counts_the_moments():
    proc, _ = _python("""
        import signal
        from jaxrlhf import exits

        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(len(seen)))
        seen = []
        for moment in ("eval", "save", "eval", "eval"):
            seen.append(moment)
            exits.signal_at(moment)
        print(got)
    """, **{exits.TEST_SIGNAL_ENV: "eval#2:SIGUSR1"})
    assert proc.stdout.strip() == "[3]", proc.stderr  # the second "eval", the third moment
    proc, _ = _python("""
        from jaxrlhf import exits
        for moment in exits.MOMENTS:
            exits.signal_at(moment)
        print("inert")
    """)
    assert proc.stdout.strip() == "inert", proc.stderr


def test_a_full_disk_anywhere_in_the_chain_is_found():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")
        except OSError as e:
            raise RuntimeError("writing the metrics failed") from e
    except RuntimeError as e:
        assert exits.no_space(e) == ("no space left on device writing /w/metrics.jsonl: no checkpoint was written yet; "
                                     "free some space and rerun the same command to resume")
    assert exits.full_disk(ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']"))
    assert exits.no_space(ValueError("no")) is None
