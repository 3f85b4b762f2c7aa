"""Simulated host devices (seqjax.core.devices): a run given a device count keeps its caller's other XLA flags
and holds one count, whatever the caller had set."""

from __future__ import annotations

import os
import subprocess
import sys

from seqjax.core.devices import with_host_devices
from test_train_support import REPO


def test_the_count_replaces_the_callers_and_keeps_every_other_flag():
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2 --xla_cpu_use_thunk_runtime"
    assert with_host_devices(flags, 8) == ("--xla_backend_optimization_level=0 --xla_cpu_use_thunk_runtime "
                                           "--xla_force_host_platform_device_count=8")
    assert with_host_devices("", 4) == "--xla_force_host_platform_device_count=4"


def test_a_child_started_with_it_sees_that_many_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": with_host_devices(with_host_devices(os.environ.get("XLA_FLAGS", ""), 2), 3)}
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3"], out.stderr[-1000:]
