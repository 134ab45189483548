"""Worker of `bench_rollout.py --cpu-devices N`: the same sampler with the batch split over N
XLA:CPU devices (one per core), in its own process because the device count is fixed when
jax starts (`--xla_force_host_platform_device_count`).

    python benchmarks/rollout_devices_worker.py --devices 2 --batch 16

Same weights as the parent (the HF model after `torch.manual_seed(0)`, converted), prompts
split by rows over a `data=N` mesh with `parallel.generate_sharded`, parameters
replicated. Prints one JSON line: the timed calls, the first call, and the greedy and
sampled tokens of fixed keys, which the parent compares with its one-device sampler's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prompts", default=None)
    args = ap.parse_args()
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common  # noqa: E402 (sets the host allocator before jax allocates)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf import parallel
    from jaxrlhf.models import load_pretrained

    if len(jax.devices()) != args.devices:
        raise RuntimeError(f"asked for {args.devices} CPU devices, jax has {len(jax.devices())}")
    hf = _common.hf_llama(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model, params = load_pretrained(tmp)
    mesh = parallel.make_mesh(f"data={args.devices}")
    p_sh = parallel.param_shardings(model, mesh)
    params = jax.device_put(params, p_sh)
    prompts = np.asarray(_common.load_workload(args.prompts)["prompts"], np.int32)
    batch = np.concatenate([prompts] * (args.batch // len(prompts) + 1))[:args.batch]

    def run(ids, key, **kw):
        kw = dict(dict(max_new_tokens=args.new_tokens), **kw)
        return parallel.generate_sharded(model, params, jnp.asarray(ids), jnp.ones(ids.shape, bool), key,
                                         mesh=mesh, params_shardings=p_sh, **kw)

    start = time.perf_counter()  # the first call at the timed shape: compile + run
    sampled = run(batch, jax.random.key(7)).response_ids.block_until_ready()
    first_call_s = time.perf_counter() - start
    greedy = run(prompts[:2], jax.random.key(0), max_new_tokens=16, temperature=0.0).response_ids
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    t = _common.timed(lambda: run(batch, next(keys)).response_ids.block_until_ready(),
                      warmup=args.warmup, repeats=args.repeats, keep_times=True)
    print(json.dumps(dict(devices=args.devices, batch=args.batch, times=t["times"], first_call_s=first_call_s,
                          greedy_tokens=np.asarray(greedy).tolist(), sampled_tokens_key7=np.asarray(sampled).tolist(),
                          jax=jax.__version__, peak_rss_mib=_common.peak_rss_mib())))


if __name__ == "__main__":
    main()
