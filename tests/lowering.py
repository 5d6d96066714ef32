"""Lowering on this CPU-only machine for devices it does not have: an abstract H100 or TPU v5e stands in (Triton
and Mosaic lowering need a device model; PTX and TPU compilation happen on the real device)."""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H100 = ("NVIDIA H100 80GB HBM3", 132, "gpu")  # device_kind, num_cores, platform
TPU_V5E = ("TPU v5 lite", 1, "tpu")


def abstract_device(kind: str, cores: int, platform: str):
    """`with abstract_device(*H100):` makes lowering target that device."""
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    return use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device))


def export_for(platform: str, f, *args):
    """`jax.export` of `jax.jit(f)(*args)` for "cuda" (an abstract H100; Triton custom calls allowed) or "tpu" (an
    abstract TPU v5e)."""
    if platform == "cuda":
        device, checks = H100, [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)]
    elif platform == "tpu":
        device, checks = TPU_V5E, []
    else:
        raise ValueError(f"platform={platform!r}: expected 'cuda' or 'tpu'")
    with abstract_device(*device):
        return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)
