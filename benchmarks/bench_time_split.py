"""What the per-step time split costs: an RL step as three timed programs (rollout, scoring,
update; `algorithms.timing.run_split`) against the same step as one fused program.

Two measurements, side by side in one run:

- the reference workload's steps (docs/benchmarks.md#the-reference-workload, random init): GRPO as in
  `bench_grpo.py` (2 prompts × 8 samples × 64 new tokens, JAX reward) and PPO as in
  `bench_ppo.py` (16 prompts × 64 new tokens, separate critic, reward model, 4 epochs),
  through `make_iteration(time_split=True / False)`, the two forms' steps interleaved
  (A, B, A, B, ...) so that both see the same machine;
- the command line's steps on the default configs (`configs/addition_grpo.py`,
  `configs/addition_ppo.py`, no SFT warm start, a 20-step reward model for PPO), with
  `--config.train.time_split=True / False` in alternating runs (A, B, A, B, A, B), the
  median and the fastest of each run's `time/step_s` over its steps that compiled nothing.

The workload rows give the median wall seconds of a step and the median CPU seconds of this
process per step (less disturbed by other processes on a shared machine).

    python benchmarks/bench_time_split.py                 # both, writes results/time_split.json
    python benchmarks/bench_time_split.py --quick         # fewer steps, a smoke run
    python benchmarks/bench_time_split.py --parts=configs # only the command line's steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

G, T_NEW, TARGET = 8, 64, 7


def _policy(seed: int, head: str = "lm"):
    import jax

    from jaxrlhf.models import Transformer, init_params

    model = Transformer(_common.jax_llama_config(), head=head)
    return model, init_params(model, jax.random.key(seed))


def _interleaved(steps: dict, repeats: int, warmup: int = 2) -> dict:
    """`{name: step()}` run in turns (each step blocks until its work is done): the median
    seconds of each over `repeats` turns, after `warmup` turns."""
    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {name: dict(_common.summary(t), cpu_median_s=statistics.median(cpu[name])) for name, t in times.items()}


def workload_grpo(prompts, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms import common, grpo
    from jaxrlhf.algorithms.experience import SamplingConfig

    model, params = _policy(0)
    tx, _ = common.make_optimizer(common.OptimConfig(lr=1e-6, max_grad_norm=1.0))
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=T_NEW, eos_id=None, pad_id=0, num_samples=G),
                          adv_eps=1e-4)
    reward = _common.token_fraction_reward(TARGET, name="frac7")
    ids = jnp.asarray(prompts[:2], jnp.int32)
    mask = jnp.ones_like(ids, bool)
    steps = {}
    for split in (False, True):
        it = grpo.make_iteration(model, tx, cfg, reward, donate=True, time_split=split, prompt_buckets=None)
        box = {"state": grpo.init_state(jax.tree.map(jnp.copy, params), tx)}

        def step(it=it, box=box):
            box["state"], m = it(box["state"], ids, mask, {}, jax.random.key(0))
            box["metrics"] = jax.device_get(m)
        steps["split" if split else "fused"] = step
        steps["split" if split else "fused"].box = box
    out = _interleaved(steps, repeats)
    out["split_parts"] = {k: float(v) for k, v in steps["split"].box["metrics"].items() if k.startswith("time/")}
    return out


def workload_ppo(prompts, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrlhf.algorithms import common, ppo
    from jaxrlhf.algorithms.experience import SamplingConfig

    actor, actor_params = _policy(0)
    rm, rm_params = _policy(1, head="score")
    critic, critic_params = _policy(2, head="score")
    tx, _ = common.make_optimizer(common.OptimConfig(lr=3e-6, max_grad_norm=1.0))
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=T_NEW, eos_id=None), num_ppo_epochs=4)
    ids = jnp.asarray(prompts[:16], jnp.int32)
    mask = jnp.ones_like(ids, bool)
    steps = {}
    for split in (False, True):
        state = ppo.init_state(cfg, actor, jax.tree.map(jnp.copy, actor_params), tx, critic_model=critic,
                               critic_params=jax.tree.map(jnp.copy, critic_params), tx_critic=tx,
                               reward=(rm, rm_params))
        it = ppo.make_iteration(actor, critic, rm, tx, tx, cfg, time_split=split)
        box = {"state": state}

        def step(it=it, box=box):
            box["state"], m = it(box["state"], ids, mask, jax.random.key(0))
            box["metrics"] = jax.device_get(m)
        steps["split" if split else "fused"] = step
        steps["split" if split else "fused"].box = box
    out = _interleaved(steps, repeats)
    out["split_parts"] = {k: float(v) for k, v in steps["split"].box["metrics"].items() if k.startswith("time/")}
    return out


def _load_config(name: str, overrides: dict):
    """`configs/<name>`'s `get_config()` with `{"section.field": value}` set (the
    command line's `--config.section.field=value`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name[:-3], _common.REPO / "configs" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for dotted, value in overrides.items():
        *path, field = dotted.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[field] = value
    return cfg


def _cli_run(config: str, split: bool, overrides: dict) -> list[float]:
    """One run of `train_and_evaluate` (the command line's, in this process): the
    `time/step_s` of its RL steps that compiled nothing."""
    from jaxrlhf.runs import train_and_evaluate

    algorithm = "grpo" if "grpo" in config else "ppo"
    with tempfile.TemporaryDirectory() as work:
        train_and_evaluate(_load_config(config, {**overrides, "train.time_split": split}), work)
        rows = [json.loads(line) for line in Path(work, "metrics.jsonl").read_text().splitlines()]
    return [r[f"{algorithm}/time/step_s"] for r in rows
            if f"{algorithm}/time/step_s" in r and r[f"{algorithm}/time/compiles"] == 0]


def configs(steps: int, rounds: int) -> dict:
    common = {"sft.steps": 0, "train.eval_every": 0, "train.export": False, "train.tensorboard": False,
              "train.progress": False, "train.log_every": 1, "train.checkpoint_every": 100000,
              "train.stop_metric": "", "train.stop_patience": 0, "train.keep_best": False}
    runs = {"addition_grpo.py": {**common, "grpo.steps": steps},
            "addition_ppo.py": {**common, "ppo.steps": steps, "reward_model.steps": 20,
                                "reward_model.samples_per_prompt": 0}}
    out = {}
    for config, overrides in runs.items():
        medians, mins = {"fused": [], "split": []}, {"fused": [], "split": []}
        for _ in range(rounds):
            for split in (False, True):
                times = _cli_run(config, split, overrides)
                medians["split" if split else "fused"].append(statistics.median(times))
                mins["split" if split else "fused"].append(min(times))
        out[config] = {k: {"run_medians_s": v, "run_mins_s": mins[k], "median_s": statistics.median(v),
                           "min_s": min(mins[k])} for k, v in medians.items()}
    return out


def table(result: dict) -> str:
    """The markdown rows of docs/benchmarks.md: each step's median (and fastest) seconds,
    fused and split, and the split's cost."""
    lines = ["| step | measure | fused (one program) | split (three timed programs) | cost |", "|---|---|---|---|---|"]
    rows = [(f"workload {k[9:].upper()}", result[k], ("median_s", "cpu_median_s"))
            for k in ("workload_grpo", "workload_ppo") if k in result]
    rows += [(f"CLI {k}", v, ("median_s", "min_s")) for k, v in result.get("configs", {}).items()]
    for name, r, measures in rows:
        for m in measures:
            fused, split = r["fused"][m], r["split"][m]
            lines.append(f"| {name} | {m} | {fused * 1e3:.1f} ms | {split * 1e3:.1f} ms | {split / fused - 1:+.1%} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="workloads,configs", help="comma-separated: workloads, configs")
    ap.add_argument("--out", default=str(_common.REPO / "benchmarks" / "results" / "time_split.json"))
    args = ap.parse_args()
    prompts = np.asarray(_common.load_workload()["prompts"])
    repeats, steps, rounds = (3, 8, 1) if args.quick else (15, 30, 3)
    parts, result = args.parts.split(","), {}
    with _common.CpuWatch() as watch:
        if "workloads" in parts:
            result.update(workload_grpo=workload_grpo(prompts, repeats), workload_ppo=workload_ppo(prompts, repeats))
        if "configs" in parts:
            result["configs"] = configs(steps, rounds)
    result["cpu_watch"] = watch.result()
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
