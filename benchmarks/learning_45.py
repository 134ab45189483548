"""Held-out exact match of the built-in task's GRPO recipe with rollout ahead of learning
(`grpo.pipeline.max_staleness` 1 and 4, the truncated-IS correction on; 4 without it, and
4 with masked IS)
beside the synchronous run, over seeds, as a markdown table for docs/results.md.

    python benchmarks/learning_45.py --seeds 0 1 2 --write docs/results.md
    python benchmarks/learning_45.py --variant tiny --seeds 0 --out /tmp/l45_tiny   # a smoke test

The runs, their table and verdicts are learning_43.py's (mean ± one standard error over
seeds; each run is `python -m jaxrlhf.train --config=configs/addition_grpo.py
--config.seed=N <overrides>` in `<out>/<run>/seed<N>`, read instead of run when its
`summary.json` is there; the synchronous run shares learning_43's name and folder, so one
`--out` serves both). The table is written between `<!-- learning_45:begin -->` and
`<!-- learning_45:end -->`. Each full run takes 3-6 minutes on a free 2-core CPU.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_43 as common  # noqa: E402

_TIS = "grpo.correction.mode=tis"
RUNS = {
    "addition_grpo": ("addition_grpo", (), "GRPO, synchronous (the README's main job)", None),
    "addition_grpo_ahead1": ("addition_grpo", ("grpo.pipeline.max_staleness=1", _TIS), "1 version ahead, TIS",
                             "addition_grpo"),
    "addition_grpo_ahead4": ("addition_grpo", ("grpo.pipeline.max_staleness=4", _TIS), "4 versions ahead, TIS",
                             "addition_grpo"),
    "addition_grpo_ahead4_none": ("addition_grpo", ("grpo.pipeline.max_staleness=4",),
                                  "4 versions ahead, no correction", "addition_grpo"),
    "addition_grpo_ahead4_mis": ("addition_grpo", ("grpo.pipeline.max_staleness=4", "grpo.correction.mode=mis"),
                                 "4 versions ahead, masked IS (IcePop)", "addition_grpo"),
}
BEGIN, END = "<!-- learning_45:begin -->", "<!-- learning_45:end -->"


def main(argv=None):
    args, pairs = common.arguments(argv, __doc__.splitlines()[0], tuple(RUNS))
    results = {(n, s): common.run(n, s, args.variant, args.out, runs=RUNS) for n, s in pairs}
    markdown = common.table(results, runs=RUNS)
    print(markdown)
    if args.write is not None:
        machine = f"{platform.machine()} with {os.cpu_count()} CPUs"
        text = (f"{BEGIN}\n## Rollout ahead of learning (issue 45)\n\n"
                f"    python benchmarks/learning_45.py --configs {args.configs} --seeds {' '.join(map(str, args.seeds))}"
                f"{' --existing' if args.existing else ''} --write docs/results.md\n\n"
                f"configs/addition_grpo.py{' (variant ' + args.variant + ')' if args.variant else ''} with "
                f"`--config.seed=N` and the overrides named, measured {datetime.date.today().isoformat()} on "
                f"{machine}; held-out greedy exact match at each run's last evaluation; SE: one standard error "
                f"over seeds.\n\n{markdown}{chr(10) + args.note + chr(10) if args.note else ''}{END}\n")
        common.write(args.write, text, BEGIN, END)
    return results


if __name__ == "__main__":
    main()
