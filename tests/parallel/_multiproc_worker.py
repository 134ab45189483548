"""One of N processes of a multi-process CPU run (gloo collectives over 127.0.0.1).

`python _multiproc_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR`: 2 CPU devices per
process, a global (data=2, fsdp=2) mesh; trains the small policy step for 3 steps from
host-local batches, writes metrics from process 0 only, saves an Orbax checkpoint from all
processes (`runs.checkpointing.Checkpointer`) and restores it into a (fsdp=4) mesh; process
0 then writes the gathered params.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The checkout this file lives in, ahead of any installed jaxrlhf (e.g. another worktree's
# editable install): the subprocess tests the same code as the parent test process.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import _models as M  # noqa: E402
from jaxrlhf import parallel  # noqa: E402
from jaxrlhf.algorithms.common import TrainState  # noqa: E402
from jaxrlhf.models import random_init  # noqa: E402
from jaxrlhf.models.transformer import Transformer  # noqa: E402
from jaxrlhf.parallel import distributed  # noqa: E402
from jaxrlhf.runs.checkpointing import Checkpointer  # noqa: E402

STEPS = 3


def main():
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    assert distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)
    assert distributed.initialize()  # idempotent
    assert jax.process_count() == nproc and jax.device_count() == 2 * nproc
    assert distributed.is_main_process() == (pid == 0)

    model, tx = Transformer(M.LLAMA), M.optimizer()
    mesh = parallel.make_mesh("data=2,fsdp=-1")
    p_sh = parallel.param_shardings(model, mesh)
    # the same host values on every process, each placing only its own shards
    params = parallel.put_sharded(random_init(M.LLAMA, seed=0)[1], p_sh)
    state, sh = parallel.place_state(TrainState.create(params, tx), p_sh)
    step = parallel.jit_step(M.make_step(model, tx), mesh=mesh, state_shardings=sh)
    for i in range(STEPS):
        local = distributed.host_local_batch(M.batch(i), mesh)
        assert local["sequences"].shape[0] == M.ROWS // nproc
        state, metrics = step(state, distributed.host_local_to_global(local, mesh), jax.random.key(i))
        distributed.write_metrics(os.path.join(out, "metrics.jsonl"), i, metrics)

    saving = Checkpointer(os.path.join(out, "ckpt"))  # every process writes its own shards
    saving.save(STEPS, state, {"step": STEPS})
    saving.close()
    mesh2 = parallel.make_mesh("data=1,fsdp=-1")
    sh2 = parallel.state_shardings(jax.eval_shape(lambda: state), parallel.param_shardings(model, mesh2))
    restoring = Checkpointer(os.path.join(out, "ckpt"))
    step, restored, _ = restoring.restore(parallel.abstract_state(state, sh2))
    restoring.close()
    assert step == STEPS, step
    a, b = distributed.gather(state.params), distributed.gather(restored.params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    if distributed.is_main_process():
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(a)[0]}
        np.savez(os.path.join(out, "params.npz"), **flat)
    distributed.sync("done")
    print(f"process {pid} ok", flush=True)


if __name__ == "__main__":
    main()
