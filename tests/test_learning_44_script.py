"""benchmarks/learning_44.py's table and its own section of docs/results.md, beside
learning_43's (the runs themselves are the config's end-to-end test:
tests/runs/test_calculator_run.py)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "learning_44.py"


def _script():
    spec = importlib.util.spec_from_file_location("learning_44", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage(acc, calls):
    return {"accuracy": acc, "well_formed_calls": 1.0, "tool_calls": calls}


def test_table_and_section_leave_the_other_scripts_section_alone(tmp_path):
    l44 = _script()
    for seed, (sft, rl) in enumerate([(0.5, 0.9), (0.52, 0.98)]):
        d = tmp_path / "runs" / "calculator_grpo" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"stages": {"after SFT": _stage(sft, 1.05),
                                                               "after GRPO": _stage(rl, 2.0)}, "seconds": 200.0}))
    results = (tmp_path / "results.md")
    results.write_text("# Results\n\n" + l44.l43.BEGIN + "\nforty-three\n" + l44.l43.END + "\n")
    l44.main(["--seeds", "0", "1", "--out", str(tmp_path / "runs"), "--write", str(results)])
    text = results.read_text()
    assert "forty-three" in text and text.count(l44.BEGIN) == 1
    assert "| 1 | 0.520 | **0.980** | +46.0 | 1.000 / 1.000 | 1.05 / 2.00 | 200 s |" in text
    assert "Mean gain over SFT: +43.0 ± 3.0 points" in text
