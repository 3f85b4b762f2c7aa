"""Simulated host devices: the XLA flag that makes the CPU backend show n devices, so meshes are tested
and planned on one machine. It takes effect only when set before jax starts its CPU backend. The
package never sets it; its tests and scripts do, each through :func:`with_host_devices`.

>>> with_host_devices("--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2", 8)
'--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8'
"""

from __future__ import annotations

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def with_host_devices(flags: str, count: int) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the host device count ``count``: the caller's other
    flags kept, a count already there replaced (a child run that appended its own would leave XLA
    two)."""
    kept = [f for f in flags.split() if not f.startswith(HOST_DEVICES_FLAG)]
    return " ".join([*kept, f"{HOST_DEVICES_FLAG}={count}"])
