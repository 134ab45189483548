"""The notebooks run top to bottom (they are committed without outputs)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


# 01 and 02 cover the primitives and GRPO; 03 (PPO, also algorithms/test_ppo.py) and 04 are heavy.
HEAVY = ("03_rlhf_ppo_four_models", "04_many_runs_vmap")


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.heavy) if p.stem in HEAVY else p for p in NOTEBOOKS],
                         ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRLHF_NOTEBOOK_SCALE", "tiny")  # the kernel inherits the environment
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
