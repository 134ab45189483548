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


def test_verdict_and_standard_error():
    l43 = _script()
    m, se = l43.mean_se([0.9, 0.95, 1.0])
    assert abs(m - 0.95) < 1e-12 and abs(se - 0.05 / 3 ** 0.5) < 1e-12
    assert l43.mean_se([0.5]) == (0.5, 0.0)
    assert l43.verdict([0.95, 0.96, 0.97], [0.90, 0.91, 0.92]).endswith("better by more than 2 SE")
    assert l43.verdict([0.94, 0.95, 0.96], [0.95, 0.96, 0.97]).endswith("within 2 SE or 3 points")
    assert l43.verdict([0.80, 0.81, 0.82], [0.95, 0.96, 0.97]).endswith("worse")


def test_a_run_with_overrides_passes_them_and_is_compared_with_its_baseline(tmp_path, monkeypatch):
    l43 = _script()
    calls = []

    def fake_run(cmd, **kw):  # what the subprocess would leave behind
        calls.append(cmd)
        workdir = Path(next(a for a in cmd if a.startswith("--workdir=")).split("=", 1)[1])
        workdir.mkdir(parents=True)
        (workdir / "summary.json").write_text(json.dumps(_summary(0.8, 0.9 if "--config.grpo.advantage=grpo" in cmd else 0.99)))
        (workdir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "grpo/clipfrac": 0.25}\n')

    monkeypatch.setattr(l43.subprocess, "run", fake_run)
    results = l43.main(["--configs", "addition_gdpo,addition_gdpo_as_grpo", "--seeds", "0", "1",
                        "--out", str(tmp_path)])
    assert [c for c in calls if "--config.grpo.advantage=grpo" in c and any("addition_gdpo.py" in a for a in c)]
    assert results[("addition_gdpo", 1)]["max_clipfrac"] == 0.25
    text = l43.table(results)
    assert "`addition_gdpo_as_grpo`: +9.0 ± 0.0 points" in text
    assert l43.verdict([0.99], [0.96, 0.97]) == "+2.5 points: too few seeds for a verdict"


def test_existing_reads_only_finished_runs_and_starts_none(tmp_path, monkeypatch):
    l43 = _script()
    (tmp_path / "addition_grpo" / "seed0").mkdir(parents=True)
    (tmp_path / "addition_grpo" / "seed0" / "summary.json").write_text(json.dumps(_summary(0.794, 0.966)))

    def no_run(*a, **kw):
        raise AssertionError("--existing must not start a run")

    monkeypatch.setattr(l43.subprocess, "run", no_run)
    results = l43.main(["--configs", "addition_grpo,addition_cispo", "--seeds", "0", "1", "--out", str(tmp_path),
                        "--existing"])
    assert set(results) == {("addition_grpo", 0)}
