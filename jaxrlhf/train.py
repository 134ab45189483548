"""Entry point: `python -m jaxrlhf.train --config=configs/<name>.py[:variant] --workdir=DIR`.

Fields are overridden with `--config.<section>.<field>=value`; the config is locked, so a
misspelt key at any depth is an error that names the nearest valid ones of its section
(`jaxrlhf.cli.parse_flags`). A workdir that holds a checkpoint resumes from it, if it was
started with the same config: a changed one is refused with the changed keys, unless they
are all safe to change and `--resume_with_changes` is given; a workdir another run holds is
refused with that run's pid and host (`jaxrlhf.runs.workdir`).

Every phase runs on the device mesh `--config.mesh` (default "data=-1": the batch split
over all devices) with the sharding rules `--config.rules` ("fsdp_tp", "fsdp" or
"replicated"), e.g. `--config.mesh=fsdp=4,tensor=2`. The processes of a multi-host job
(TPU pod, SLURM, `launch/local_multiprocess.sh`) are joined first
(`jaxrlhf.parallel.distributed.initialize`); the mesh then spans the devices of all of
them, each process reads its own rows of every batch, and process 0 writes the metrics,
summary and export. Such a job needs a `--workdir` that every process can reach.

A failed run exits with status 1 and ends stderr with one line, `error: <what went wrong,
naming the key/file/line/tensor>`, and where its full traceback is: `<workdir>/train.log`,
the run's log (`jaxrlhf.cli`, `jaxrlhf.runlog`); `JAXRLHF_TRACEBACK=1` prints it on stderr.
SIGTERM stops the run with status 0 and Ctrl-C with status 130, each with a last line
saying which checkpoints are kept (`jaxrlhf.exits`).
"""

from __future__ import annotations

import functools
import logging
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

from jaxrlhf import cli, exits, runlog

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file (optionally :variant).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported model "
                                                "(default: a new temporary directory).")
_RESUME_WITH_CHANGES = flags.DEFINE_bool(
    "resume_with_changes", False, "Resume a workdir whose config changed only in keys that are safe to change "
    "(options marked resume-safe in docs/options.md: logging, evaluation, checkpointing, the mesh, a phase's steps); "
    "other changes are refused whatever this says.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    exits.install()  # SIGTERM: a clean stop wherever it comes; a second Ctrl-C: at once
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    runlog.capture()  # kept for <workdir>/train.log, written once the run owns its workdir
    from jaxrlhf.host_allocator import tune_host_allocator
    from jaxrlhf.parallel import distributed
    from jaxrlhf.runs import train_and_evaluate  # after flag parsing: keeps --help fast

    # JAXRLHF_HOST_ALLOCATOR=reuse: XLA:CPU's per-step buffers are reused, not re-mapped.
    # Applied before any computation; off by default (see jaxrlhf/host_allocator.py).
    tune_host_allocator()

    # Joins the other processes of a multi-host job (TPU pod, SLURM, launch/*.sh) before any
    # device is touched; a no-op for a single process.
    if distributed.initialize() and not _WORKDIR.value:
        raise app.UsageError("a multi-process job needs --workdir (a folder every process can reach): the "
                             "processes write one checkpoint together")
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="jaxrlhf_")
    exits.set_workdir(workdir)  # the last line names its checkpoints
    logging.getLogger("jaxrlhf").info("workdir: %s", workdir)
    train_and_evaluate(_CONFIG.value, workdir, resume_with_changes=_RESUME_WITH_CHANGES.value)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(functools.partial(cli.run_main, main), flags_parser=cli.parse_flags)
