"""Held-out exact match of GRPO and the issue-43 variants (CISPO, GDPO, REINFORCE++-baseline)
over seeds, as a markdown table for docs/results.md.

    python benchmarks/learning_43.py                       # seeds 0 1 2 of the four configs
    python benchmarks/learning_43.py --write docs/results.md
    python benchmarks/learning_43.py --variant tiny --seeds 0 --out /tmp/l43_tiny   # a smoke test

Runs `python -m jaxrlhf.train --config=configs/<name>.py[:variant] --config.seed=N` for each
config and seed, one at a time, in `<out>/<name>/seed<N>` (a run whose `summary.json` is
already there is read, not run again: an interrupted measurement picks up where it
stopped), then prints one row per config and seed: the held-out greedy exact match after
SFT, after GRPO (the last evaluation) and the wall time, and the mean gain per config.
`--write PATH` puts the table into PATH between the markers
`<!-- learning_43:begin -->` and `<!-- learning_43:end -->` (appended as a new section
when they are not there yet). Each full run takes 3-5 minutes on a free 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("addition_grpo", "addition_cispo", "addition_gdpo", "addition_rpp_baseline")
WHAT = {"addition_grpo": "GRPO (the README's main job)", "addition_cispo": "CISPO, 2 minibatches",
        "addition_gdpo": "GDPO, + format reward x 100", "addition_rpp_baseline": "REINFORCE++-baseline"}
BEGIN, END = "<!-- learning_43:begin -->", "<!-- learning_43:end -->"


def run(name: str, seed: int, variant: str, out: Path) -> dict:
    """The summary of one run (run now unless its `summary.json` exists)."""
    workdir = out / name / f"seed{seed}"
    summary = workdir / "summary.json"
    if not summary.exists():
        config = f"configs/{name}.py" + (f":{variant}" if variant else "")
        cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={config}", f"--workdir={workdir}",
               f"--config.seed={seed}"]
        print("$", " ".join(cmd[1:]), flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def table(results: dict[tuple[str, int], dict]) -> str:
    """Markdown: one row per (config, seed), exact match after SFT and after GRPO."""
    lines = ["| config | seed | after SFT | after RL | gain | wall time |", "|---|---:|---:|---:|---:|---:|"]
    for (name, seed), s in results.items():
        sft, rl = s["stages"]["after SFT"]["accuracy"], s["stages"]["after GRPO"]["accuracy"]
        lines.append(f"| `{name}.py` ({WHAT.get(name, name)}) | {seed} | {sft:.3f} | **{rl:.3f}** | "
                     f"{100 * (rl - sft):+.1f} | {s['seconds']:.0f} s |")
    lines += ["", "| config | mean after SFT | mean after RL | mean gain |", "|---|---:|---:|---:|"]
    for name in dict.fromkeys(n for n, _ in results):
        rows = [s["stages"] for (n, _), s in results.items() if n == name]
        sft = sum(r["after SFT"]["accuracy"] for r in rows) / len(rows)
        rl = sum(r["after GRPO"]["accuracy"] for r in rows) / len(rows)
        lines.append(f"| `{name}.py` | {sft:.3f} | {rl:.3f} | {100 * (rl - sft):+.1f} |")
    return "\n".join(lines) + "\n"


def section(markdown_table: str, *, variant: str, seeds, when: str, machine: str, configs=CONFIGS,
            note: str = "") -> str:
    """The results.md section between the markers (`note`: a paragraph after the table)."""
    chosen = "" if tuple(configs) == CONFIGS else f" --configs {','.join(configs)}"
    return (f"{BEGIN}\n## Issue 43: CISPO, GDPO and REINFORCE++-baseline beside GRPO\n\n"
            f"    python benchmarks/learning_43.py{' --variant ' + variant if variant else ''}{chosen} "
            f"--seeds {' '.join(map(str, seeds))} --write docs/results.md\n\n"
            f"Each config{' (variant ' + variant + ')' if variant else ''} run with `--config.seed=N`, measured {when} on {machine}; held-out greedy "
            "exact match on the test sums at the last evaluation of each run. The configs differ from "
            "addition_grpo.py only where the algorithm needs it (their docstrings).\n\n"
            f"{markdown_table}{chr(10) + note + chr(10) if note else ''}{END}\n")


def write(path: Path, text: str) -> None:
    """`text` (begins with BEGIN, ends with END) in place of the marked section of `path`,
    or appended."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    path.write_text(new)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names in configs/")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variant", default="", help="a config variant, e.g. 'tiny' ('': the full runs)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/learning_43"), help="the runs' workdirs")
    ap.add_argument("--write", type=Path, default=None, help="a markdown file to put the table in (docs/results.md)")
    ap.add_argument("--note", default="", help="a paragraph written under the table (with --write)")
    args = ap.parse_args(argv)
    results = {(name, seed): run(name, seed, args.variant, args.out)
               for name in args.configs.split(",") for seed in args.seeds}
    markdown = table(results)
    print(markdown)
    if args.write is not None:
        when = datetime.date.today().isoformat()
        write(args.write, section(markdown, variant=args.variant, seeds=args.seeds, when=when,
                                  machine=f"{platform.machine()} with {os.cpu_count()} CPUs",
                                  configs=args.configs.split(","), note=args.note))
    return results


if __name__ == "__main__":
    main()
