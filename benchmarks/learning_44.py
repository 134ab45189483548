"""Held-out exact match of the built-in multi-turn tool task (`configs/calculator_grpo.py`:
SFT on demonstrations, then GRPO on episodes) over seeds, as a markdown table for
docs/results.md.

    python benchmarks/learning_44.py                        # seeds 0 1 2
    python benchmarks/learning_44.py --write docs/results.md
    python benchmarks/learning_44.py --variant tiny --seeds 0 --out /tmp/l44_tiny   # a smoke test

Runs `python -m jaxrlhf.train --config=configs/calculator_grpo.py[:variant] --config.seed=N`
in `<out>/calculator_grpo/seed<N>`, one at a time (a run whose `summary.json` is there is
read, not run again: `benchmarks/learning_43.py`'s `run`), then prints per seed the held-out
greedy exact match after SFT and after GRPO, the share of well-formed calculator calls and
the calls per episode at both points, and the wall time; then the mean gain ± one standard
error over seeds. `--write PATH` puts the table between `<!-- learning_44:begin -->` and
`<!-- learning_44:end -->` in PATH. Each full run takes 3-5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
from pathlib import Path

_spec = importlib.util.spec_from_file_location("learning_43", Path(__file__).with_name("learning_43.py"))
l43 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(l43)

NAME = "calculator_grpo"
BEGIN, END = "<!-- learning_44:begin -->", "<!-- learning_44:end -->"


def table(results: dict[int, dict]) -> str:
    """Markdown: one row per seed, then the mean gain ± SE."""
    lines = ["| seed | after SFT | after GRPO | gain | well-formed calls (SFT / GRPO) | calls per episode (SFT / GRPO) "
             "| wall time |", "|---:|---:|---:|---:|---:|---:|---:|"]
    gains = []
    for seed, s in results.items():
        sft, rl = s["stages"]["after SFT"], s["stages"]["after GRPO"]
        gains.append(rl["accuracy"] - sft["accuracy"])
        lines.append(f"| {seed} | {sft['accuracy']:.3f} | **{rl['accuracy']:.3f}** | {100 * gains[-1]:+.1f} | "
                     f"{sft['well_formed_calls']:.3f} / {rl['well_formed_calls']:.3f} | "
                     f"{sft['tool_calls']:.2f} / {rl['tool_calls']:.2f} | {s['seconds']:.0f} s |")
    m, se = l43.mean_se(gains)
    lines += ["", f"Mean gain over SFT: {100 * m:+.1f} ± {100 * se:.1f} points (one standard error over "
                  f"{len(gains)} seeds)."]
    return "\n".join(lines) + "\n"


def section(markdown_table: str, *, variant: str, seeds, when: str, machine: str, note: str = "") -> str:
    return (f"{BEGIN}\n## Episodes: sums with a calculator (`calculator_grpo.py`)\n\n"
            f"    python benchmarks/learning_44.py{' --variant ' + variant if variant else ''} "
            f"--seeds {' '.join(map(str, seeds))} --write docs/results.md\n\n"
            f"Measured {when} on {machine}; held-out greedy exact match on the 200 test sums at the end of "
            "each phase; SFT on the demonstrations of an imperfect expert (docs/episodes.md"
            "#a-built-in-task-sums-with-a-calculator), then GRPO on episodes with the calculator.\n\n"
            f"{markdown_table}{chr(10) + note + chr(10) if note else ''}{END}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variant", default="", help="a config variant, e.g. 'tiny' ('': the full runs)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/learning_44"), help="the runs' workdirs")
    ap.add_argument("--write", type=Path, default=None, help="a markdown file to put the table in (docs/results.md)")
    ap.add_argument("--note", default="", help="a paragraph written under the table (with --write)")
    args = ap.parse_args(argv)
    results = {seed: l43.run(NAME, seed, args.variant, args.out) for seed in args.seeds}
    markdown = table(results)
    print(markdown)
    if args.write is not None:
        l43.write(args.write, section(markdown, variant=args.variant, seeds=args.seeds,
                                      when=datetime.date.today().isoformat(),
                                      machine=f"{platform.machine()} with {os.cpu_count()} CPUs",
                                      note=args.note), BEGIN, END)
    return results


if __name__ == "__main__":
    main()
