"""On-policy distillation on the default task: the student's held-out exact match after SFT,
after OPD from the default recipe's policy, and after GRPO from the same warm start.

    python benchmarks/opd_addition.py --root /tmp/opd_addition [--seeds 0 1 2] [--teacher DIR]

Per seed, three runs through the command line (`python -m jaxrlhf.train`), each in its own
workdir under `--root` (a rerun resumes or reuses a finished one):

1. the teacher, `configs/addition_grpo.py` (2 layers, width 128; skipped with `--teacher`,
   an existing export folder used for every seed);
2. `configs/addition_opd.py` (1 layer, width 128: the default recipe's SFT warm start, then
   OPD with `opd.teacher_path` = 1's export);
3. `configs/addition_grpo.py` with `--config.model.num_layers=1`: GRPO on the same student
   from the same warm start (the same SFT config and seed, so the same "after SFT" row).

Prints one line per seed (teacher after GRPO; student after SFT, after OPD, after GRPO, from
each run's `summary.json`) and writes them to `--root/results.json`. Extra `--set` options
(`opd.steps=200`) go to the OPD run. Not a timing: the CPU time is whatever the machine gives.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _train(config: str, workdir: Path, *overrides: str) -> dict:
    summary = workdir / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={REPO / 'configs' / config}",
               f"--workdir={workdir}", *(f"--config.{o}" for o in overrides)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads(summary.read_text())["stages"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="the workdirs' parent folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--teacher", type=Path, default=None, help="an existing teacher export (skips run 1)")
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value options of the OPD run")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        root = args.root / f"seed{seed}"
        teacher, teacher_acc = args.teacher, None
        if teacher is None:
            stages = _train("addition_grpo.py", root / "teacher", f"seed={seed}")
            teacher, teacher_acc = root / "teacher" / "export", stages["after GRPO"]["accuracy"]
        distilled = _train("addition_opd.py", root / "opd", f"seed={seed}", f"opd.teacher_path={teacher}", *args.set)
        grpo = _train("addition_grpo.py", root / "student_grpo", f"seed={seed}", "model.num_layers=1")
        row = dict(seed=seed, teacher=teacher_acc, student_sft=distilled["after SFT"]["accuracy"],
                   student_sft_grpo_run=grpo["after SFT"]["accuracy"], student_opd=distilled["after OPD"]["accuracy"],
                   student_grpo=grpo["after GRPO"]["accuracy"])
        results.append(row)
        print(json.dumps(row), flush=True)
    (args.root / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
