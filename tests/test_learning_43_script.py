"""benchmarks/learning_43.py's table and its section of docs/results.md (the runs themselves
are the configs' own end-to-end tests: tests/runs/test_grpo_variant_configs.py)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "learning_43.py"


def _script():
    spec = importlib.util.spec_from_file_location("learning_43", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(sft, rl, seconds=10.0):
    return {"stages": {"after SFT": {"accuracy": sft}, "after GRPO": {"accuracy": rl}}, "seconds": seconds}


def test_table_reads_finished_runs_and_replaces_its_section(tmp_path):
    l43 = _script()
    for name, seed, s in [("addition_grpo", 0, _summary(0.794, 0.966)), ("addition_cispo", 0, _summary(0.5, 0.25))]:
        (tmp_path / "runs" / name / f"seed{seed}").mkdir(parents=True)
        (tmp_path / "runs" / name / f"seed{seed}" / "summary.json").write_text(json.dumps(s))
    results = l43.main(["--configs", "addition_grpo,addition_cispo", "--seeds", "0", "--out", str(tmp_path / "runs"),
                        "--write", str(tmp_path / "results.md")])  # finished runs are read, not run
    assert set(results) == {("addition_grpo", 0), ("addition_cispo", 0)}
    text = (tmp_path / "results.md").read_text()
    assert "| 0 | 0.794 | **0.966** | +17.2 | 10 s |" in text and "| 0 | 0.500 | **0.250** | -25.0 |" in text
    (tmp_path / "results.md").write_text("# Results\n\nbefore\n\n" + text + "\nafter\n")
    l43.write(tmp_path / "results.md", l43.section(l43.table({("addition_gdpo", 1): _summary(0.7, 0.8)}),
                                                   variant="", seeds=[1], when="today", machine="here"))
    text = (tmp_path / "results.md").read_text()
    assert text.count(l43.BEGIN) == 1 and "addition_cispo" not in text and "| 1 | 0.700 | **0.800** |" in text
    assert text.startswith("# Results\n\nbefore\n\n") and text.endswith("\nafter\n")
