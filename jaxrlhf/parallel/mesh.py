"""Device meshes from a config with three axis names: `data`, `fsdp`, `tensor`.

`data` replicates the model and splits the batch; `fsdp` splits the batch *and* shards
parameters and optimizer state (gathered just in time for each matmul); `tensor` splits the
heads / MLP / vocabulary dimensions of the matmuls themselves (Megatron-style). Every mesh
built here has all three axes, in this order, so rules can always name them (an unused
axis has size 1).

    make_mesh("data=-1,fsdp=4,tensor=2")     # -1: whatever devices are left
    make_mesh({"fsdp": 8})                    # data=1, tensor=1
    make_mesh(MeshConfig(data=2, fsdp=4))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the `data`, `fsdp` and `tensor` axes; at most one may be -1 ("the rest")."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @classmethod
    def parse(cls, spec: "MeshConfig | Mapping[str, int] | str | None") -> "MeshConfig":
        """From a `MeshConfig`, a dict, `"data=-1,fsdp=4,tensor=2"`, or None (all data)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            items = {}
            for part in filter(None, (p.strip() for p in spec.split(","))):
                name, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"mesh spec {spec!r}: expected 'axis=size' items, got {part!r}")
                try:
                    items[name.strip()] = int(value)
                except ValueError:
                    raise ValueError(f"mesh spec {spec!r}: size of {name.strip()!r} is not an integer") from None
            spec = items
        if hasattr(spec, "to_dict"):  # ml_collections.ConfigDict
            spec = spec.to_dict()
        spec = dict(spec)
        unknown = sorted(set(spec) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; the axis names are {list(AXES)}")
        sizes = {name: int(spec.get(name, 1)) for name in AXES}
        if "data" not in spec and -1 not in sizes.values():
            sizes["data"] = -1  # the batch axis absorbs the remaining devices by default
        return cls(**sizes)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """The concrete `(data, fsdp, tensor)` sizes for `num_devices` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        bad = [f"{n}={s}" for n, s in zip(AXES, sizes) if s == 0 or s < -1]
        if bad:
            raise ValueError(f"mesh sizes must be positive or -1, got {', '.join(bad)}")
        free = [i for i, s in enumerate(sizes) if s == -1]
        if len(free) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {self}")
        fixed = math.prod(s for s in sizes if s != -1)
        if free:
            if num_devices % fixed:
                raise ValueError(
                    f"mesh {self._fmt()}: the fixed axes use {fixed} devices, which does not divide the "
                    f"{num_devices} available devices")
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(f"mesh {self._fmt()} needs {fixed} devices but {num_devices} are available; "
                             "set one axis to -1 to absorb the rest")
        return tuple(sizes)

    def _fmt(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in AXES)


def make_mesh(spec: "MeshConfig | Mapping[str, int] | str | None" = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes `("data", "fsdp", "tensor")` over all (or the given) devices.

    Uses `jax.make_mesh`, which orders devices so that the innermost axis (`tensor`) lies on
    the fastest interconnect (within a host / ICI ring). Axis types are `Auto`: shardings
    are given by `jit` arguments and propagated by the compiler.

    Raises:
      ValueError: an unknown axis name, a size that is 0 or below -1, or sizes whose product
        does not match the device count.
    """
    cfg = MeshConfig.parse(spec)
    devs = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devs))
    auto = (AxisType.Auto,) * len(AXES)
    if devices is None:
        return jax.make_mesh(shape, AXES, axis_types=auto)
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devs)
    except Exception:  # an explicit device subset that make_mesh cannot lay out: keep the order
        return Mesh(np.asarray(devs).reshape(shape), AXES, axis_types=auto)


def batch_axis_size(mesh: Mesh) -> int:
    """How many ways the batch is split: `data × fsdp`."""
    return int(mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))
