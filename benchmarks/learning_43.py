"""Held-out exact match of GRPO and the issue-43 variants (CISPO, GDPO, REINFORCE++-baseline)
over seeds, as a markdown table for docs/results.md.

    python benchmarks/learning_43.py                       # seeds 0 1 2 of every run below
    python benchmarks/learning_43.py --write docs/results.md
    python benchmarks/learning_43.py --variant tiny --seeds 0 --out /tmp/l43_tiny   # a smoke test

A run is a config of `configs/` with command-line overrides (`RUNS`): the four configs, and
`addition_gdpo_as_grpo`, addition_gdpo.py with GRPO's advantage (the same two rewards,
summed before GRPO's normalisation: the baseline GDPO has to beat). Each is run as
`python -m jaxrlhf.train --config=configs/<config>.py[:variant] --config.seed=N ...` in
`<out>/<run>/seed<N>`, one at a time (a run whose `summary.json` is already there is read,
not run again: an interrupted measurement picks up where it stopped). The table gives per
run and seed the held-out greedy exact match after SFT and after RL and the wall time, then
per run the mean ± one standard error over seeds and its verdict against its baseline
(`BASELINE`): the difference of the means, and whether it is within 2 standard errors of
the difference (or 3 points), or above it by more than 2. CISPO's rows give the largest
`grpo/clipfrac` a run logged (the issue asks for > 0: with one update per batch its ratio
is 1 and it is REINFORCE). `--write PATH` puts the table into PATH between the markers
`<!-- learning_43:begin -->` and `<!-- learning_43:end -->` (appended as a new section
when they are not there yet). Each full run takes 3-6 minutes on a free 2-core CPU.
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
# run name -> (config file in configs/, overrides, what it is, the run it is compared with)
RUNS = {
    "addition_grpo": ("addition_grpo", (), "GRPO, the README's main job", None),
    "addition_cispo": ("addition_cispo", (), "CISPO, 2 minibatches", "addition_grpo"),
    "addition_rpp_baseline": ("addition_rpp_baseline", (), "REINFORCE++-baseline", "addition_grpo"),
    "addition_gdpo": ("addition_gdpo", (), "GDPO: exact match + 100 x format", "addition_gdpo_as_grpo"),
    "addition_gdpo_as_grpo": ("addition_gdpo", ("grpo.advantage=grpo",), "GRPO on the same summed reward", None),
}
CONFIGS = tuple(RUNS)
BEGIN, END = "<!-- learning_43:begin -->", "<!-- learning_43:end -->"


def run(name: str, seed: int, variant: str, out: Path, runs: dict = RUNS) -> dict:
    """The summary of one run (run now unless its `summary.json` exists), with the largest
    `grpo/clipfrac` its metrics logged as `max_clipfrac`."""
    workdir = out / name / f"seed{seed}"
    summary = workdir / "summary.json"
    if not summary.exists():
        file, overrides, _, _ = runs.get(name, (name, (), "", None))
        config = f"configs/{file}.py" + (f":{variant}" if variant else "")
        cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={config}", f"--workdir={workdir}",
               f"--config.seed={seed}", *(f"--config.{o}" for o in overrides)]
        print("$", " ".join(cmd[1:]), flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(summary.read_text())
    metrics = workdir / "metrics.jsonl"
    clip = [json.loads(line).get("grpo/clipfrac") for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result["max_clipfrac"] = max((c for c in clip if c is not None), default=None)
    return result


def mean_se(xs) -> tuple[float, float]:
    """The mean of `xs` and its standard error (sample standard deviation / sqrt(n); 0 for one)."""
    n = len(xs)
    m = sum(xs) / n
    return m, (sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5 if n > 1 else 0.0


def verdict(ours, theirs) -> str:
    """`ours` against `theirs` (held-out exact match per seed): the difference of the means
    in points, and whether it is above 2 standard errors of the difference, within them (or
    within 3 points), or below."""
    (m1, s1), (m2, s2) = mean_se(ours), mean_se(theirs)
    d, se = 100 * (m1 - m2), 100 * (s1 ** 2 + s2 ** 2) ** 0.5
    if min(len(ours), len(theirs)) < 2:
        return f"{d:+.1f} points: too few seeds for a verdict"
    if d > 2 * se and se > 0:
        word = "better by more than 2 SE"
    elif d >= -max(2 * se, 3.0):
        word = "within 2 SE or 3 points"
    else:
        word = "worse"
    return f"{d:+.1f} ± {se:.1f} points: {word}"


def table(results: dict[tuple[str, int], dict], runs: dict = RUNS) -> str:
    """Markdown: one row per (config, seed), exact match after SFT and after GRPO."""
    what = lambda name: runs.get(name, (name, (), name, None))
    lines = ["| run | seed | after SFT | after RL | gain | wall time | max clipfrac |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for (name, seed), s in results.items():
        sft, rl = s["stages"]["after SFT"]["accuracy"], s["stages"]["after GRPO"]["accuracy"]
        clip = s.get("max_clipfrac")
        lines.append(f"| `{name}` ({what(name)[2]}) | {seed} | {sft:.3f} | **{rl:.3f}** | "
                     f"{100 * (rl - sft):+.1f} | {s['seconds']:.0f} s | {'' if clip is None else f'{clip:.3f}'} |")
    after = {}
    for (name, _), s in results.items():
        after.setdefault(name, []).append(s["stages"]["after GRPO"]["accuracy"])
    lines += ["", "| run | seeds | mean after SFT | mean after RL ± SE | against |", "|---|---:|---:|---:|---|"]
    for name, rl in after.items():
        sft = [s["stages"]["after SFT"]["accuracy"] for (n, _), s in results.items() if n == name]
        m, se = mean_se(rl)
        base = what(name)[3]
        against = f"`{base}`: {verdict(rl, after[base])}" if base in after else ""
        lines.append(f"| `{name}` | {len(rl)} | {sum(sft) / len(sft):.3f} | {m:.3f} ± {se:.3f} | {against} |")
    return "\n".join(lines) + "\n"


def section(markdown_table: str, *, variant: str, seeds, when: str, machine: str, configs=CONFIGS,
            note: str = "", existing: bool = False) -> str:
    """The results.md section between the markers (`note`: a paragraph after the table)."""
    chosen = "" if tuple(configs) == CONFIGS else f" --configs {','.join(configs)}"
    return (f"{BEGIN}\n## Issue 43: CISPO, GDPO and REINFORCE++-baseline beside GRPO\n\n"
            f"    python benchmarks/learning_43.py{' --variant ' + variant if variant else ''}{chosen} "
            f"--seeds {' '.join(map(str, seeds))}{' --existing' if existing else ''} --write docs/results.md\n\n"
            f"Each config{' (variant ' + variant + ')' if variant else ''} run with `--config.seed=N`, measured {when} on {machine}; held-out greedy "
            "exact match on the test sums at the last evaluation of each run. The configs differ from "
            "addition_grpo.py only where the algorithm needs it (their docstrings); SE: one standard error over seeds.\n\n"
            f"{markdown_table}{chr(10) + note + chr(10) if note else ''}{END}\n")


def write(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """`text` (begins with `begin`, ends with `end`) in place of the marked section of
    `path`, or appended."""
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text.rstrip("\n") + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    path.write_text(new)


def arguments(argv, description: str, configs) -> tuple[argparse.Namespace, list[tuple[str, int]]]:
    """The command line of a learning script (this one's, learning_45.py's) and the
    `(run, seed)` pairs it asks for (only those finished in `--out` with `--existing`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--configs", default=",".join(configs), help="comma-separated run names (RUNS) or config names in configs/")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variant", default="", help="a config variant, e.g. 'tiny' ('': the full runs)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/learning_43"), help="the runs' workdirs")
    ap.add_argument("--write", type=Path, default=None, help="a markdown file to put the table in (docs/results.md)")
    ap.add_argument("--note", default="", help="a paragraph written under the table (with --write)")
    ap.add_argument("--existing", action="store_true",
                    help="only read the runs already finished in --out (start none): a partial table")
    args = ap.parse_args(argv)
    pairs = [(name, seed) for name in args.configs.split(",") for seed in args.seeds]
    if args.existing:
        pairs = [(n, s) for n, s in pairs if (args.out / n / f"seed{s}" / "summary.json").exists()]
    return args, pairs


def main(argv=None):
    args, pairs = arguments(argv, __doc__.splitlines()[0], CONFIGS)
    results = {(name, seed): run(name, seed, args.variant, args.out) for name, seed in pairs}
    markdown = table(results)
    print(markdown)
    if args.write is not None:
        when = datetime.date.today().isoformat()
        write(args.write, section(markdown, variant=args.variant, seeds=args.seeds, when=when,
                                  machine=f"{platform.machine()} with {os.cpu_count()} CPUs",
                                  configs=args.configs.split(","), note=args.note, existing=args.existing))
    return results


if __name__ == "__main__":
    main()
