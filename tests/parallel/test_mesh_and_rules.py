"""Mesh configs, rule sets and the single-process paths of `distributed` (no extra devices)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf import parallel
from jaxrlhf.parallel import distributed
from jaxrlhf.parallel.mesh import MeshConfig


def test_mesh_config_parse_and_resolve():
    assert MeshConfig.parse("data=-1,fsdp=4,tensor=2").resolve(16) == (2, 4, 2)
    assert MeshConfig.parse({"fsdp": 4}).resolve(8) == (2, 4, 1)  # data absorbs the rest
    assert MeshConfig.parse({"data": 2, "fsdp": -1}).resolve(8) == (2, 4, 1)
    assert MeshConfig.parse(None).resolve(3) == (3, 1, 1)
    assert MeshConfig(data=1, fsdp=2, tensor=2).resolve(4) == (1, 2, 2)


@pytest.mark.parametrize("spec, n, needle", [
    ("data=3,fsdp=2,tensor=1", 8, "needs 6 devices but 8"),
    ("data=-1,fsdp=3", 8, "does not divide"),
    ("data=-1,fsdp=-1", 8, "at most one"),
    ("data=0", 8, "positive or -1"),
    ("pipeline=2", 8, "unknown mesh axes ['pipeline']"),
    ("fsdp:2", 8, "axis=size"),
])
def test_mesh_config_errors(spec, n, needle):
    with pytest.raises(ValueError) as e:
        MeshConfig.parse(spec).resolve(n)
    assert needle in str(e.value)


def test_make_mesh_single_device():
    mesh = parallel.make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.size == 1
    with pytest.raises(ValueError, match="needs 2 devices but 1"):
        parallel.make_mesh("data=1,fsdp=2")


def test_rule_presets_and_forms():
    assert parallel.get_rules(None) is parallel.DEFAULT_RULES
    assert parallel.get_rules("fsdp") is parallel.FSDP_RULES
    assert parallel.get_rules({"embed": ["fsdp", "tensor"], "norm": None}) == (
        ("embed", ("fsdp", "tensor")), ("norm", None))
    with pytest.raises(ValueError, match="unknown sharding rules preset"):
        parallel.get_rules("zero3")
    for rules in parallel.PRESETS.values():  # every preset covers every axis name of the model
        names = {r for r, _ in rules}
        assert {"batch", "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "norm"} <= names


def test_distributed_single_process(monkeypatch, tmp_path):
    for var in ("JAXRLHF_COORDINATOR_ADDRESS", "JAXRLHF_NUM_PROCESSES", "JAXRLHF_PROCESS_ID",
                "JAXRLHF_DISTRIBUTED", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() is False  # no cluster: a no-op
    assert distributed.initialize(num_processes=1) is False
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2)
    assert distributed.is_main_process()
    assert distributed.host_slice(8) == slice(0, 8)
    batch = {"x": np.arange(8)}
    assert distributed.host_local_batch(batch)["x"].tolist() == list(range(8))
    path = tmp_path / "m.jsonl"
    distributed.write_metrics(path, 3, {"loss": np.float32(0.5)})
    assert path.read_text() == '{"step": 3, "loss": 0.5}\n'
