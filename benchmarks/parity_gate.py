"""Sampler = trainer log-probs for every model family: the figures behind the test gate.

    python benchmarks/parity_gate.py                    # every family, float32 and bfloat16
    python benchmarks/parity_gate.py --families gemma3 --dtypes bfloat16
    python benchmarks/parity_gate.py --xla-fast-compile # at the test suite's XLA flags

Not a timing. For each family's tiny random Hugging Face checkpoint (the model tests'
`tests/models/conftest.py`: 3 layers, V = 300, every weight random, sliding window 5 where
the family has one), loaded in float32 and in bfloat16 (params, compute and KV cache),
this runs `measure` of tests/rollout/test_parity_gate.py: 2 left-padded prompts × 2
samples, up to 10 tokens each, drawn by the static sampler (`generate`, two CPU row
blocks) and the continuous one (`generate_continuous`, 3 slots), then scored by GRPO's
trainer path (`experience.score_responses`: prompts run once per group, the fused LM
head). It prints one markdown table: the valid response tokens, max |Δ log p| over them,
and `ops.importance_weights(trainer, sampler, mask, mode="none")`'s `mismatch_kl`, with the
gate each dtype is held to (float32: max |Δ| ≤ 1e-5; bfloat16: mismatch_kl ≤ 1e-3).

XLA runs at its default optimisation level (the library's); `--xla-fast-compile` adds the
test suite's `--xla_backend_optimization_level=0` (tests/_xla.py), which reproduces the
tests' own figures: the two may differ in the last bits. On a CPU the bfloat16 figures are
XLA:CPU's (its bf16 dots and fusions); an accelerator rounds otherwise.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=None, help="default: every family of the gate")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--xla-fast-compile", action="store_true",
                    help="the test suite's XLA flag (tests/_xla.py): the tests' own figures")
    args = ap.parse_args()

    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    if args.xla_fast_compile:
        import _xla

        os.environ["XLA_FLAGS"] = _xla.flags(base=os.environ.get("XLA_FLAGS"))
    import jax

    from tests.models.conftest import torch
    from tests.rollout import test_parity_gate as gate

    torch.set_num_threads(1)
    families = args.families or list(gate.FAMILIES)
    store = gate.Checkpoints(Path(tempfile.mkdtemp(prefix="parity_gate_")))
    bounds = {"float32": f"max abs ≤ {gate.FLOAT32_MAX_ABS:g}", "bfloat16": f"KL ≤ {gate.BFLOAT16_MISMATCH_KL:g}"}
    lines = ["| family | dtype | sampler | valid tokens | max abs Δ log p | mismatch_kl | gate | holds |",
             "|---|---|---|---:|---:|---:|---|---|"]
    worst = {}
    for family in families:
        path = store.path(family)
        for dtype in args.dtypes:
            found = gate.measure(*gate.load(path, dtype))
            for sampler, g in found.items():
                holds = (g.max_abs <= gate.FLOAT32_MAX_ABS if dtype == "float32"
                         else g.mismatch_kl <= gate.BFLOAT16_MISMATCH_KL)
                lines.append(f"| {family} | {dtype} | {sampler} | {g.tokens} | {g.max_abs:.2e} | "
                             f"{g.mismatch_kl:.2e} | {bounds[dtype]} | {'yes' if holds else '**no**'} |")
                key = (dtype, "max_abs" if dtype == "float32" else "mismatch_kl")
                value = getattr(g, key[1])
                if value >= worst.get(key, (-1.0, ""))[0]:
                    worst[key] = (value, f"{family} {sampler}")
            print(lines[-2], lines[-1], sep="\n", file=sys.stderr, flush=True)  # progress
    flags = os.environ.get("XLA_FLAGS", "") or "(none)"
    print(f"jax {jax.__version__} on {jax.default_backend()} ({_cpu_name()}, {os.cpu_count()} cores); "
          f"XLA_FLAGS {flags}\n")
    print("\n".join(lines))
    print()
    for (dtype, name), (value, where) in sorted(worst.items()):
        print(f"largest {name} at {dtype}: {value:.2e} ({where})")


if __name__ == "__main__":
    main()
