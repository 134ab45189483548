"""`python _full_disk.py <python -m jaxrlhf.train's arguments>`: the command line on a disk
that is full from the second checkpoint save on, for tests/runs/test_exits.py where no
tmpfs can be mounted (not root, no mount permission).

The second save raises orbax's kind of error (no file name, "No space left on device" in
the message), and from then on every write of the run log `train.log` fails with ENOSPC:
what a real full disk does to the run.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys

import orbax.checkpoint as ocp

from jaxrlhf import runlog

_saves = []
_save = ocp.CheckpointManager.save


class _FullStream:
    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = write


def _save_on_a_disk_that_fills(self, step, *args, **kwargs):
    _saves.append(step)
    if len(_saves) > 1:
        handler = runlog._state.get("file")
        if handler is not None:
            handler.flush()
            handler.stream = _FullStream()
        raise ValueError(f"RESOURCE_EXHAUSTED: Error writing step {step}: No space left on device [os_error_code='28']")
    return _save(self, step, *args, **kwargs)


if __name__ == "__main__":
    ocp.CheckpointManager.save = _save_on_a_disk_that_fills
    sys.argv = ["jaxrlhf.train", *sys.argv[1:]]
    runpy.run_module("jaxrlhf.train", run_name="__main__", alter_sys=True)
