"""Benchmarks of `jaxrlhf.ops`: GAE against TRL's loop and rlax, token log-probs' memory.

    python benchmarks/bench_ops.py                  # both parts, markdown to stdout
    python benchmarks/bench_ops.py --part gae       # GAE only (seconds)
    python benchmarks/bench_ops.py --part logprobs  # V = 151,936: minutes, ~8 GB RAM

with the package importable (`pip install -e ".[bench]"`, or `PYTHONPATH=.` in a checkout).

Writes every number to benchmarks/results/ops.json (or --out). Not a test: nothing here
asserts speed, but the GAE outputs of all implementations are checked to agree.

(a) GAE on float32 [B, T] with random valid lengths, γ = 1, λ = 0.95:
  - TRL: the `for t in reversed(range(T))` loop of TRL's PPO trainer on torch tensors;
  - rlax: `truncated_generalized_advantage_estimation` vmapped over the batch, jitted;
  - jaxrlhf: `ops.gae`, jitted, with its "scan", "associative" and "blocked" methods.
(b) `ops.token_logprobs` and `ops.entropy` at B=8, T=512, V=151,936 against the naive
  `take_along_axis(log_softmax(logits))` and `−Σ softmax·log_softmax`: XLA's temporary
  buffers from the compiled executable's memory analysis (forward, and for the gradient
  of the sum), and wall time, for float32 and bf16 logits.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

GAE_SHAPES = [(16, 64), (64, 512), (256, 2048)]
GAMMA, LAM = 1.0, 0.95
LOGPROB_SHAPE = (8, 512, 151_936)
MiB = 2**20


def _time(fn, repeats: int, warmup: int = 2) -> dict:
    """Min / median / max wall milliseconds of `fn()` (which must block until done)."""
    t = _common.timed(fn, warmup=warmup, repeats=repeats)
    return {"min_ms": 1e3 * t["min_s"], "median_ms": 1e3 * t["median_s"], "max_ms": 1e3 * t["max_s"],
            "runs": t["runs"]}


def _gae_data(b: int, t: int):
    rng = np.random.default_rng(0)
    rewards = rng.standard_normal((b, t)).astype(np.float32)
    values = rng.standard_normal((b, t)).astype(np.float32)
    lengths = rng.integers(1, t + 1, size=b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    return rewards, values, mask


def _trl_gae(rewards, values, gamma, lam):
    """TRL's PPO trainer loop (trl/trainer/ppo_trainer.py), verbatim in structure."""
    import torch

    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    return advantages, advantages + values


@jax.jit
def _rlax_gae(rewards, values, mask):
    import rlax

    # rlax's discount_t = γ·m_{t+1} and values with V_T = 0 appended express the same
    # masked recurrence as docs/concepts.md#advantages-token-level-or-sequence-level
    # (padding zeroed beforehand, as TRL also does).
    rewards = jnp.where(mask, rewards, 0.0)
    values = jnp.where(mask, values, 0.0)
    next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1))).astype(jnp.float32)
    values_ext = jnp.pad(values, ((0, 0), (0, 1)))
    gae_one = functools.partial(rlax.truncated_generalized_advantage_estimation, lambda_=LAM)
    adv = jax.vmap(gae_one)(r_t=rewards, discount_t=GAMMA * next_mask, values=values_ext)
    adv = jnp.where(mask, adv, 0.0)
    return adv, jnp.where(mask, adv + values, 0.0)


def bench_gae(repeats: int) -> list[dict]:
    import torch

    torch.set_num_threads(2)
    # The jitted forms take 0.05-5 ms a call: a median of 10 calls moved by 30 % between
    # runs on this shared machine, so they get 100 timed calls after 10 warm-ups (rlax too).
    jax_repeats, jax_warmup = max(repeats, 100), 10
    ours = {
        m: jax.jit(functools.partial(ops.gae, gamma=GAMMA, lam=LAM, method=m))
        for m in ("scan", "associative", "blocked")
    }
    rows = []
    for b, t in GAE_SHAPES:
        rewards, values, mask = _gae_data(b, t)
        # TRL zeroes padding before its loop; the loop itself is what is timed.
        r_torch = torch.from_numpy(np.where(mask, rewards, 0.0).astype(np.float32))
        v_torch = torch.from_numpy(np.where(mask, values, 0.0).astype(np.float32))
        r_j, v_j, m_j = (jax.device_put(x) for x in (rewards, values, mask))

        with torch.no_grad():
            trl_adv, _ = _trl_gae(r_torch, v_torch, GAMMA, LAM)
            trl = _time(lambda: _trl_gae(r_torch, v_torch, GAMMA, LAM), max(repeats // 2, 6))
        rlax_adv, _ = _rlax_gae(r_j, v_j, m_j)
        rlax = _time(lambda: jax.block_until_ready(_rlax_gae(r_j, v_j, m_j)), jax_repeats, jax_warmup)
        row = {"B": b, "T": t, "trl_loop": trl, "rlax": rlax}
        for method, fn in ours.items():
            adv = fn(r_j, v_j, m_j).advantages
            # Same numbers as TRL (TRL leaves garbage-free zeros past the end only if the
            # padding is zero, which it is here) and rlax, up to float32 rounding.
            np.testing.assert_allclose(adv, np.where(mask, trl_adv.numpy(), 0.0), atol=2e-3)
            np.testing.assert_allclose(adv, rlax_adv, atol=2e-3)
            row[f"jaxrlhf_{method}"] = _time(lambda: jax.block_until_ready(fn(r_j, v_j, m_j)),
                                             jax_repeats, jax_warmup)
        rows.append(row)
    return rows


def _naive_logprobs(logits, targets, temperature=1.0):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _naive_entropy(logits):
    x = logits.astype(jnp.float32)
    return -jnp.sum(jax.nn.softmax(x, axis=-1) * jax.nn.log_softmax(x, axis=-1), axis=-1)


def _temp_mib(fn, *args) -> float:
    """XLA's temporary buffers for `fn(*args)`, from the compiled executable."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / MiB


def bench_logprobs(repeats: int) -> list[dict]:
    b, t, v = LOGPROB_SHAPE
    variants = {
        "token_logprobs: naive log_softmax + gather": (_naive_logprobs, True),
        "token_logprobs: ops.token_logprobs": (ops.token_logprobs, True),
        "entropy: naive softmax · log_softmax": (_naive_entropy, False),
        "entropy: ops.entropy (default chunks)": (ops.entropy, False),
        "entropy: ops.entropy (chunk_size=T, one piece)": (
            functools.partial(ops.entropy, chunk_size=t), False
        ),
    }
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = jax.jit(lambda k: jax.random.normal(k, (b, t, v), dtype))(jax.random.key(0))
        targets = jax.random.randint(jax.random.key(1), (b, t), 0, v)
        reference = {}
        for name, (fn, takes_targets) in variants.items():
            args = (logits, targets) if takes_targets else (logits,)
            compiled = jax.jit(fn).lower(*args).compile()
            out = compiled(*args)
            kind = name.split(":")[0]
            reference.setdefault(kind, out)
            np.testing.assert_allclose(out, reference[kind], atol=1e-3)
            timing = _time(lambda: jax.block_until_ready(compiled(*args)), repeats, warmup=1)
            rows.append({
                "dtype": jnp.dtype(dtype).name, "variant": name, "B": b, "T": t, "V": v,
                "logits_MiB": logits.nbytes / MiB,
                "temp_MiB": compiled.memory_analysis().temp_size_in_bytes / MiB,
                "grad_temp_MiB": _temp_mib(
                    jax.grad(lambda x, *rest: jnp.sum(fn(x, *rest))), *args
                ),
                **timing,
            })
        del logits
    return rows


def _gae_table(rows: list[dict]) -> str:
    lines = [
        "| [B, T] | implementation | min ms | median ms | max ms | speed-up vs TRL | vs rlax |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        trl, rlax = row["trl_loop"]["median_ms"], row["rlax"]["median_ms"]
        for key in ("trl_loop", "rlax", "jaxrlhf_scan", "jaxrlhf_associative", "jaxrlhf_blocked"):
            s = row[key]
            lines.append(
                f"| ({row['B']}, {row['T']}) | {key} | {s['min_ms']:.3f} | {s['median_ms']:.3f} | "
                f"{s['max_ms']:.3f} | {trl / s['median_ms']:.1f}x | {rlax / s['median_ms']:.2f}x |"
            )
    return "\n".join(lines)


def _logprobs_table(rows: list[dict]) -> str:
    lines = [
        "| logits | variant | XLA temp MiB | temp MiB under grad | min ms | median ms | max ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['dtype']} ({row['logits_MiB']:.0f} MiB) | {row['variant']} | "
            f"{row['temp_MiB']:.1f} | {row['grad_temp_MiB']:.1f} | {row['min_ms']:.0f} | "
            f"{row['median_ms']:.0f} | {row['max_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "gae", "logprobs"), default="all")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (>= 6)")
    parser.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/ops.json)")
    args = parser.parse_args()
    repeats = max(args.repeats, 6)

    results = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
            "jax_backend": jax.default_backend(), "jax": jax.__version__,
        },
    }
    if args.part in ("all", "gae"):
        import rlax
        import torch

        results["machine"].update(torch=torch.__version__, rlax=rlax.__version__)
        results["gae"] = bench_gae(repeats)
        print("## GAE (float32, γ = 1, λ = 0.95)\n\n" + _gae_table(results["gae"]) + "\n")
    if args.part in ("all", "logprobs"):
        results["token_logprobs"] = bench_logprobs(max(repeats // 2, 3))
        print("## token_logprobs and entropy, B=8, T=512, V=151,936\n\n"
              + _logprobs_table(results["token_logprobs"]) + "\n")
    results["machine"]["load_average_at_end"] = os.getloadavg()

    print(f"wrote {_common.write_json(args.out, 'ops.json', results)}")


if __name__ == "__main__":
    main()
