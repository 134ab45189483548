"""QLoRA through the command line: `configs/addition_sft.py:tiny` with rank-4 adapters on an
NF4 base and a scanned layer stack (`--config.model.lora.rank=4 --config.model.lora.quantize=nf4`,
as docs/training.md shows) runs, checkpoints the quantised base, resumes exactly, and
exports a merged folder that `transformers` loads and a PEFT folder on the de-quantised base.
Both runs share the session's compilation cache (the resumed one compiles nothing new)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compile_cache import cache_env, session_folder  # noqa: E402

pytestmark = pytest.mark.heavy  # QLoRA end to end; the quantised base also in models/test_quant.py

REPO = Path(__file__).resolve().parents[2]
ARGS = ("--config.model.lora.rank=4", "--config.model.lora.quantize=nf4", "--config.model.scan_layers=True")


def _train(workdir: Path, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **cache_env(cache))
    cmd = [sys.executable, "-m", "jaxrlhf.train", f"--config={REPO}/configs/addition_sft.py:tiny",
           f"--workdir={workdir}", *ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _rows(workdir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(r).items() if "/time/" not in k}
            for r in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return session_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache):
    workdir = tmp_path_factory.mktemp("qlora") / "run"
    return workdir, _train(workdir, cache)


def test_the_checkpoint_holds_the_quantised_base_and_the_run_logs_its_size(run):
    workdir, proc = run
    assert "QLoRA: base params" in proc.stderr and "(layer projections as nf4)" in proc.stderr
    metadata = (workdir / "sft" / "6" / "state" / "_METADATA").read_text()
    assert '"codes"' in metadata and '"scales"' in metadata and '"lora_a"' in metadata


def test_resumes_exactly(run, tmp_path, cache):
    """Without its last checkpoint (a kill after step 3's save), the rerun restores step 3
    (adapters, their optimizer state, the NF4 base) and logs what the full run logged."""
    full, _ = run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "sft" / "6")
    proc = _train(resumed, cache)
    assert "sft: resuming at step 3 of 6" in proc.stderr
    assert _rows(resumed) == _rows(full)
    assert json.loads((resumed / "summary.json").read_text())["stages"] == \
        json.loads((full / "summary.json").read_text())["stages"]


def test_export_loads_in_transformers_and_equals_peft_on_the_dequantised_base(run, tmp_path):
    """The merged folder runs in `transformers`; the PEFT folder, folded into its base by
    `peft` itself, gives the merged weights (at this size the trained adapters move the
    logits by ~1e-7 only, so the weights are compared). The PEFT folder names its base
    relative to itself, so it is loaded here from a moved workdir, as docs/training.md shows."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    workdir, _ = run
    moved = tmp_path / "moved"
    shutil.move(workdir, moved)  # the old path no longer exists
    try:
        export = moved / "export"
        peft_config = json.loads((export / "peft" / "adapter_config.json").read_text())
        assert peft_config["base_model_name_or_path"] == "./base"  # de-quantised, written inside the PEFT folder
        ids = torch.as_tensor(np.random.default_rng(0).integers(0, 12, (2, 7)))
        with torch.no_grad():
            merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
            assert np.isfinite(merged(input_ids=ids).logits.numpy()).all()
            base_path = export / "peft" / peft_config["base_model_name_or_path"]
            base = transformers.AutoModelForCausalLM.from_pretrained(base_path).eval()
            base_weights = {k: v.clone() for k, v in base.state_dict().items()}
            folded = peft.PeftModel.from_pretrained(base, export / "peft").merge_and_unload().state_dict()
    finally:
        shutil.move(moved, workdir)
    for name, w in merged.state_dict().items():
        if name.endswith("proj.weight"):
            assert float((w - base_weights[name]).abs().max()) > 1e-4, name  # the adapters were trained
        np.testing.assert_allclose(folded[name].numpy(), w.numpy(), atol=1e-6, rtol=0, err_msg=name)
