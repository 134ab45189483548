"""Rollout ahead of learning vs the synchronous loop: wall time per update and generated
tokens/s of the command line's GRPO phase, at simulated reward latencies, in one run.

The workload: the built-in addition task's prompts, no SFT warm start, a Llama of the
reference workload's trunk (hidden 256, intermediate 688, 4 layers, 4/2 heads, head_dim
64, float32); 16 prompts × 8 samples a step, up to 32 new tokens at τ = 1. The untrained
policy ends a response where it happens to draw EOS, so response lengths are long-tailed
(geometric; their mean and max are recorded). The reward is the task's plus a host
(Python) function that sleeps `latency × N / 16` per batch of N samples: `latency` per
sample, scored 16 at a time (a reward service of 16 workers, as a sandbox farm or a judge
would be); `reward.timeout=None` runs it in the run's process.

For each latency the same run goes synchronously (`grpo.pipeline.max_staleness=0`) and one
version ahead (`max_staleness=1`, the deterministic schedule, truncated-IS correction), and
the script records the median `time/step_s` over the steps after the first two (which
compile), generated tokens per second (valid response tokens / that step time), and the
ratio sync / async.

    python benchmarks/bench_async.py --out /tmp/bench_async.json
    python benchmarks/bench_async.py --steps 6 --latencies 0 50   # a smoke run, not a result
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WORKERS = 16  # the simulated reward service's concurrency
LATENCY_ENV = "JAXRLHF_BENCH_REWARD_LATENCY_MS"


def slow_reward(prompts, completions, **kwargs):
    """0 for every sample, after `latency × N / WORKERS` seconds (the latency from the
    environment, in ms per sample)."""
    latency = float(os.environ.get(LATENCY_ENV, "0")) / 1000.0
    time.sleep(latency * len(completions) / WORKERS)
    return [0.0] * len(completions)


def config(steps: int, staleness: int):
    from jaxrlhf.runs import config_base as base

    c = base.recipe(str(ROOT / "configs" / "addition_grpo.py"), "addition_grpo", None)
    c.unlock()
    c.model.update(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                   max_position_embeddings=64)
    c.sft.steps = 0
    c.grpo.update(steps=steps, prompts_per_step=16, pool_size=None, dynamic_sampling=False, guide_coef=0.0)
    c.grpo.sampling.update(max_new_tokens=32, num_samples=8)
    c.grpo.pipeline.max_staleness = staleness
    if staleness:
        c.grpo.correction.mode = "tis"
    c.reward.update(fns="bench_async:slow_reward", timeout=None)
    c.train.update(eval_every=0, checkpoint_every=10_000, log_every=1, progress=False, tensorboard=False,
                   export=False, show_samples=0)
    c.task.num_test = 16
    return c


def run(steps: int, staleness: int, latency_ms: float) -> dict:
    from jaxrlhf.runs import train_and_evaluate

    os.environ[LATENCY_ENV] = str(latency_ms)
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        train_and_evaluate(config(steps, staleness), workdir)
        wall = time.perf_counter() - t0
        rows = [json.loads(r) for r in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "grpo/time/step_s" in r][2:]  # the first two steps compile
    step_s = statistics.median(r["grpo/time/step_s"] for r in rows)
    tokens = statistics.mean(r["grpo/response_tokens"] for r in rows)
    return {"max_staleness": staleness, "latency_ms": latency_ms, "steps_timed": len(rows),
            "step_s_median": step_s, "tokens_per_s": tokens / step_s, "response_tokens_mean": tokens,
            "response_length_mean": statistics.mean(r["grpo/response_length/mean"] for r in rows),
            "response_length_max": max(r["grpo/response_length/max"] for r in rows),
            "host_reward_s_median": statistics.median(r.get("grpo/time/host_reward_s", 0.0) for r in rows),
            "rollout_s_median": statistics.median(r.get("grpo/time/rollout_s", float("nan")) for r in rows),
            "wall_s": wall}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--latencies", type=float, nargs="+", default=[0.0, 50.0, 200.0], help="ms per sample")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for latency in args.latencies:
        sync = run(args.steps, 0, latency)
        ahead = run(args.steps, 1, latency)
        rows += [sync, ahead]
        print(f"latency {latency:g} ms/sample: sync {sync['step_s_median']:.3f} s/update "
              f"(rollout {sync['rollout_s_median']:.3f} s, host reward {sync['host_reward_s_median']:.3f} s), "
              f"async {ahead['step_s_median']:.3f} s/update: speed-up {sync['step_s_median'] / ahead['step_s_median']:.2f}x; "
              f"tokens/s {sync['tokens_per_s']:.0f} -> {ahead['tokens_per_s']:.0f}", flush=True)
    result = {"rows": rows, "steps": args.steps, "cpu_count": os.cpu_count()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
