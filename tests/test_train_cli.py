"""What `python -m jaxrlhf.train` shows when something is wrong: exit status 1, one last line
`error: ...` naming the key/file, the traceback in `<workdir>/train.log` once the run owns
its workdir, and nothing written for a run refused before any work.

Every CLI case fails before training (a few seconds of imports each); the checks behind
them are also tested in-process (`cli.unknown_key`, `runs.validation`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _xla
import pytest

from jaxrlhf import cli
from jaxrlhf.runs import config_base as base
from jaxrlhf.runs import validation

REPO = Path(__file__).resolve().parents[1]
GRPO = f"--config={REPO}/configs/addition_grpo.py:tiny"


def _train(*args, devices: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = _xla.flags(devices)
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines, proc.stdout
    return lines[-1]


@pytest.mark.parametrize("args, last", [
    # an unknown key one level above its nearest match: ml_collections said only "'lrr'"
    (["--config.grpo.lrr=1e-3"], "error: --config.grpo.lrr: config.grpo has no key 'lrr'; "
                                 "did you mean --config.grpo.optim.lr?"),
    (["--config.grpo.steps=-3"], "error: grpo.steps=-3 is impossible: it must be >= 1 "
                                 "(set JAXRLHF_TRACEBACK=1 for the full traceback)"),
    (["--config.sft.steps=-1"], "error: sft.steps=-1 is impossible: it must be >= 0 "
                                "(set JAXRLHF_TRACEBACK=1 for the full traceback)"),
], ids=["unknown_key", "negative_rl_steps", "negative_sft_steps"])
def test_refused_before_any_work(tmp_path, args, last):
    workdir = tmp_path / "w"
    proc = _train(GRPO, *args, f"--workdir={workdir}")
    assert (proc.returncode, _last_line(proc)) == (1, last), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    """A tokenizer folder for `model.path` (a chat template, and with `named` a second, named
    one as `tokenizer_config.json` lists them) and a JSONL of prompts: all a text task reads
    before the run claims its workdir (the model is built after)."""
    from jaxrlhf import data

    root = tmp_path_factory.mktemp("chat")
    template = "{% for m in messages %}({{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    tok = data.CharTokenizer().to_hf()
    tok.chat_template = template
    tok.save_pretrained(root / "ckpt")
    named = shutil.copytree(root / "ckpt", root / "named")
    (named / "chat_template.jinja").unlink()
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": template}, {"name": "../x", "template": template}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "t.jsonl").write_text("".join(json.dumps({"question": f"{a}+1", "answer": f"#### {a + 1}"}) + "\n"
                                          for a in range(8)))
    return root


@pytest.mark.parametrize("folder, arg, last", [
    ("ckpt", "--config.task.stop_tokens=zzz", "error: task.stop_tokens: 'zzz' is neither a token of the tokenizer"),
    ("ckpt", "--config.task.stop_strings=[1", "error: task.stop_strings='[1' is not a JSON list"),
    ("ckpt", "--config.task.chat_template_kwargs=[1]", "error: task.chat_template_kwargs='[1]' is not a JSON object"),
    ("ckpt", "--config.task.chat_template_timeout=-1",
     "error: task.chat_template_timeout=-1.0 is impossible: it must be > 0 (or None: off)"),
    ("ckpt", "--config.train.max_param_norm_change=-1",
     "error: train.max_param_norm_change=-1.0 is impossible: it must be > 0 (or None: off)"),
    # transformers refuses to save it at the export, after training: the name is checked with the tokenizer
    ("named", "--config.train.export=True", "error: model.path={}: its tokenizer has a chat template named '../x', "
                                            "which the export would save outside"),
], ids=["stop_tokens", "stop_strings", "template_kwargs", "template_timeout", "max_param_norm_change",
        "template_name"])
def test_task_options_refused_before_the_workdir_is_claimed(tmp_path, chat_files, folder, arg, last):
    """Checked with the task, built before `claim`: no lock, no config record, no log."""
    workdir = tmp_path / "w"
    proc = _train(f"--config={REPO}/configs/hf_gsm8k_grpo.py:tiny", f"--config.model.path={chat_files / folder}",
                  f"--config.task.path={chat_files / 't.jsonl'}", arg, f"--workdir={workdir}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _last_line(proc).startswith(last.format(chat_files / folder)), proc.stderr[-3000:]
    assert _last_line(proc).endswith("(set JAXRLHF_TRACEBACK=1 for the full traceback)")
    assert not workdir.exists()


def test_batch_that_misfits_the_mesh_is_refused_before_sft(tmp_path):
    """On 2 devices, 3 prompts per GRPO step do not split: said before the SFT phase runs.
    (Without the tiny config's dynamic sampling: its pool of 8 prompts splits, and the 3 kept
    groups' 12 rows do too.)"""
    workdir = tmp_path / "w"
    proc = _train(GRPO, "--config.grpo.prompts_per_step=3", "--config.grpo.dynamic_sampling=False",
                  f"--workdir={workdir}", devices=2)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _last_line(proc).startswith("error: grpo.prompts_per_step=3 does not split into the 2 row shards of mesh "
                                       "(data=2, fsdp=1, tensor=1)")
    assert not workdir.exists()


def test_failure_in_a_run_names_the_file_and_logs_the_traceback(tmp_path):
    """A truncated config.json of `model.path`: one line naming the file; the full traceback
    (and the run's log lines) in `<workdir>/train.log`, appended per run start."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen2", "hidden_')
    workdir = tmp_path / "w"
    proc = _train(GRPO, f"--config.model.path={ckpt}", f"--workdir={workdir}")
    log = workdir / "train.log"
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last_line(proc)
    assert last.startswith(f"error: {ckpt / 'config.json'} is truncated or corrupt: it is not valid JSON "
                           "(Unterminated string"), last
    assert last.endswith(f" (full traceback in {log})")
    assert "Traceback" not in proc.stderr
    text = log.read_text()
    assert text.count("run start: pid") == 1 and f"--workdir={workdir}" in text
    assert "INFO jaxrlhf: workdir:" in text and "Traceback (most recent call last)" in text
    assert "json.decoder.JSONDecodeError" in text  # the library error, kept as the cause


def test_unknown_key_help_at_every_level():
    config = base.mlc.ConfigDict(dict(algorithm="grpo", grpo=base.grpo(), train=base.train()))
    assert cli.unknown_key(config, "grpo.optim.lr") is None
    assert cli.unknown_key(config, "grpo.optim.lrr") == ("--config.grpo.optim.lrr: config.grpo.optim has no key "
                                                         "'lrr'; did you mean --config.grpo.optim.lr?")
    assert cli.unknown_key(config, "lrr") == ("--config.lrr: config has no key 'lrr'; "
                                              "did you mean --config.grpo.optim.lr?")  # found a level deeper
    assert cli.unknown_key(config, "grpo.sampling.num_sample").endswith(
        "did you mean --config.grpo.sampling.num_samples?")
    assert cli.unknown_key(config, "trian.log_every").endswith("did you mean --config.train?")
    assert cli.unknown_key(config, "grpo.zzzzzz") == (
        "--config.grpo.zzzzzz: config.grpo has no key 'zzzzzz'; its keys: " + ", ".join(config.grpo.keys()))
    assert cli.unknown_key(config, "grpo.steps.x") == (
        "--config.grpo.steps.x: config.grpo.steps is a value (100), not a section with key 'x'")


def test_one_line_keeps_the_type_only_where_the_message_needs_it():
    from jaxrlhf.models import CheckpointError

    assert cli.one_line(ValueError("grpo.steps=-3 is impossible\n(details)")) == "grpo.steps=-3 is impossible"
    assert cli.one_line(CheckpointError("/c/config.json is truncated")) == "/c/config.json is truncated"
    assert cli.one_line(KeyError("answer")) == "KeyError: 'answer'"
    assert cli.one_line(RuntimeError()) == "RuntimeError"
    assert cli.one_line(ValueError("x" * 1000)) == "x" * 600 + " ..."


class _Mesh:
    """A stand-in for `sharding.Placement.check_rows` on a mesh of `ways` row shards."""

    def __init__(self, ways: int):
        self.ways = ways

    def check_rows(self, rows, field):
        if rows % self.ways:
            raise ValueError(f"{field}={rows} does not split into {self.ways}")


def _config(algorithm, **sections):
    c = base.mlc.ConfigDict(dict(algorithm=algorithm, sft=base.sft(steps=2, batch_size=8), train=base.train(),
                                 grpo=base.grpo(prompts_per_step=4, sampling=dict(num_samples=4)),
                                 ppo=base.ppo(prompts_per_step=4, num_ppo_epochs=1), dpo=base.pairs_phase("dpo"),
                                 reward_model=base.pairs_phase("reward_model", batch_size=8)))
    for name, fields in sections.items():
        c[name].update(fields)
    return c


@pytest.mark.parametrize("algorithm, sections, ways, message", [
    ("grpo", {}, 4, None),
    ("grpo", {"sft": {"batch_size": 6}}, 4, "sft.batch_size=6 does not split into 4"),
    ("grpo", {"sft": {"steps": 0, "batch_size": 6}}, 4, None),  # SFT does not run: its batch is not checked
    ("grpo", {"grpo": {"dynamic_sampling": True, "pool_size": 6}}, 4, "grpo.pool_size=6"),
    ("grpo", {"grpo": {"dynamic_sampling": True, "pool_size": 2}}, 1,
     r"grpo.pool_size=2 is impossible with grpo.dynamic_sampling: the pool must hold at least grpo.prompts_per_step=4"),
    ("grpo", {"grpo": {"pool_size": 2}}, 1, None),  # without dynamic sampling the pool is unused
    ("grpo", {"grpo": {"num_minibatches": 3}}, 1, "grpo.prompts_per_step × grpo.sampling.num_samples = 16 rows"),
    ("ppo", {"ppo": {"num_minibatches": 2, "num_microbatches": 4}}, 1,
     r"a PPO minibatch \(prompts_per_step × num_samples / num_minibatches\) = 2 rows"),
    ("ppo", {"reward_model": {"batch_size": 6}}, 4, "reward_model.batch_size=6"),
    ("ppo", {"ppo": {"reward": "task"}, "reward_model": {"batch_size": 6}}, 4, None),  # no reward model phase
    ("dpo", {"dpo": {"batch_size": 32, "num_microbatches": 3}}, 1, "dpo.batch_size = 32 rows"),
    ("dpo", {"dpo": {"steps": 0}}, 1, r"dpo.steps=0 is impossible: it must be >= 1"),
    ("sft", {"sft": {"steps": 0}}, 1, r"sft.steps=0 is impossible: it must be >= 1"),
    ("grpo", {"grpo": {"optim": {"lr": -1e-3}}}, 1, r"grpo.optim.lr=-0.001 is impossible"),
    ("grpo", {"train": {"eval_batch_size": 0}}, 1, r"train.eval_batch_size=0 is impossible"),
    ("grpo", {"grpo": {"sampling": {"min_new_tokens": 9}}}, 1,
     r"grpo.sampling.min_new_tokens=9 is impossible: it must be <= grpo.sampling.max_new_tokens=8"),
    ("ppo", {"ppo": {"sampling": {"min_new_tokens": -1}}}, 1, r"ppo.sampling.min_new_tokens=-1 is impossible"),
    ("grpo", {"grpo": {"sampling": {"slots": -1}}}, 1, r"grpo.sampling.slots=-1 is impossible: it must be >= 0"),
])
def test_every_phase_checked_against_the_mesh_before_any_work(algorithm, sections, ways, message):
    config = _config(algorithm, **sections)
    if message is None:
        validation.check_config(config, _Mesh(ways))
    else:
        with pytest.raises(ValueError, match=message):
            validation.check_config(config, _Mesh(ways))


# Run by a small process of its own, which starts the run and reads its peak RSS with
# `os.wait4`: a child forked straight from the test's worker would count the worker's own
# pages in its maximum (a worker grown to 2 GiB by earlier tests read as a 2 GiB run).
_MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _train_measured(*args) -> tuple[subprocess.CompletedProcess, int, float]:
    """`_train`, with the peak RSS (bytes) of that one run (`os.wait4` in a small process of
    its own, `_MEASURE`: RUSAGE_CHILDREN would be the largest of every child the test
    session ever waited for) and its seconds."""
    import tempfile
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla.flags(None))
    argv = [sys.executable, "-m", "jaxrlhf.train", *args]
    with tempfile.TemporaryDirectory() as tmp:
        rss = os.path.join(tmp, "maxrss")
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _MEASURE, rss, *argv], env=env, cwd=REPO, capture_output=True,
                              text=True)
        seconds = time.monotonic() - start
        peak = int(open(rss).read())
    return proc, peak * (1 if sys.platform == "darwin" else 1024), seconds  # KiB on Linux


@pytest.fixture(scope="module")
def truncated_generation_config(tmp_path_factory, chat_files):
    """A run whose model folder has `generation_config.json` cut mid-file, read with the task
    after its eight rows (`text_stop_ids`): (process, peak RSS, seconds, folder, workdir) —
    also the memory of a run that reads no huge row, for the cases below."""
    root = tmp_path_factory.mktemp("gen")
    ckpt = shutil.copytree(chat_files / "ckpt", root / "ckpt")
    (ckpt / "generation_config.json").write_text('{"eos_token_id": [2, ')
    proc, peak, seconds = _train_measured(
        f"--config={REPO}/configs/hf_gsm8k_grpo.py:tiny", f"--config.model.path={ckpt}",
        f"--config.task.path={chat_files / 't.jsonl'}", f"--workdir={root / 'w'}")
    print(f"truncated generation_config.json: exit {proc.returncode} in {seconds:.1f} s, "
          f"peak RSS {peak / 2**20:.0f} MiB")
    return proc, peak, seconds, ckpt, root / "w"


def test_a_truncated_generation_config_is_named(truncated_generation_config):
    """One line naming the file, before the run claims its workdir."""
    proc, _, _, ckpt, workdir = truncated_generation_config
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last_line(proc)
    assert last.startswith(f"error: {ckpt / 'generation_config.json'} is truncated or corrupt: it is not valid JSON"), \
        last
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()


@pytest.fixture(scope="module")
def huge_row_file(chat_files):
    """Eight good prompts and, as line 3, one valid row whose question is 50 M characters
    (about 50 MB, written in 1 MB pieces): 50× `task.max_row_bytes`' default of 1 MiB."""
    path = chat_files / "huge.jsonl"
    good = [json.dumps({"question": f"{a}+1", "answer": f"#### {a + 1}"}) + "\n" for a in range(8)]
    with open(path, "w") as f:
        f.writelines(good[:2])
        f.write('{"question": "')
        for _ in range(50):
            f.write("7" * 10**6)
        f.write('", "answer": "#### 1"}\n')
        f.writelines(good[2:])
    assert path.stat().st_size > 50 * 10**6
    return path


# Each case reads the 50 MB line past in 1 MiB + 1 byte pieces: its peak RSS stays within
# a few MiB of the run that reads no huge row (measured: 484-489 MiB). Holding the line
# even once costs 48 MiB; with max_row_bytes=0 (no bound) the same run peaks at 628 MiB.
@pytest.mark.parametrize("arg, last", [
    ("--config.task.on_error=raise", "error: {}:3: the line is longer than max_row_bytes=1048576 bytes "
                                     "(set JAXRLHF_TRACEBACK=1 for the full traceback)"),
    # the default: the task is built from the eight other rows; the bad stop token, checked
    # after them, ends the run before its workdir is claimed, so no training runs
    ("--config.task.stop_tokens=zzz", "error: task.stop_tokens: 'zzz' is neither a token of the tokenizer"),
], ids=["raise", "skip"])
def test_a_huge_row_is_refused_before_it_is_expanded(tmp_path, chat_files, huge_row_file,
                                                     truncated_generation_config, arg, last):
    workdir = tmp_path / "w"
    proc, peak, seconds = _train_measured(
        f"--config={REPO}/configs/hf_gsm8k_grpo.py:tiny", f"--config.model.path={chat_files / 'ckpt'}",
        f"--config.task.path={huge_row_file}", arg, f"--workdir={workdir}")
    print(f"huge row, {arg}: exit {proc.returncode} in {seconds:.1f} s, peak RSS {peak / 2**20:.0f} MiB")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _last_line(proc).startswith(last.format(huge_row_file)), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()
    assert peak < 1.5 * 2**30 and peak < truncated_generation_config[1] + 24 * 2**20, peak
