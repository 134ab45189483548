"""Entry point: `python -m jaxrlhf.train --config=configs/<name>.py[:variant] --workdir=DIR`.

Fields are overridden with `--config.<section>.<field>=value`; the config is locked, so a
misspelt key is an error that names the nearest valid one. A workdir that holds a
checkpoint resumes from it. The processes of a multi-host job are joined first
(`jaxrlhf.parallel.distributed.initialize`), but config runs are single-process for now:
multi-host training goes through the `jaxrlhf.parallel` API (docs/scale.md).
"""

from __future__ import annotations

import logging
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file (optionally :variant).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported model "
                                                "(default: a new temporary directory).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxrlhf.parallel import distributed
    from jaxrlhf.runs import train_and_evaluate  # after flag parsing: keeps --help fast

    # Joins the other processes of a multi-host job (TPU pod, SLURM, launch/*.sh) before any
    # device is touched; a no-op for a single process.
    distributed.initialize()
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="jaxrlhf_")
    logging.getLogger("jaxrlhf").info("workdir: %s", workdir)
    train_and_evaluate(_CONFIG.value, workdir)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
