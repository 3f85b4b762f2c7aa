"""Meshes: the sharding rules, the -1 fill, and the same losses on 8 forced host devices as on one."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from jax.sharding import PartitionSpec as P

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.model.sharding import mesh_shape, param_spec
from seqjax.train.distributed import distributed_settings
from test_train_support import REPO, assert_ok, cli_env, run_cli, tiny_overrides, train_losses


def mesh_of(data=1, fsdp=1, tensor=1):
    return SimpleNamespace(shape={"data": data, "fsdp": fsdp, "tensor": tensor})


def test_minus_one_fills_the_remaining_devices_and_bad_sizes_are_refused():
    def shape(data, fsdp, tensor, devices, context=1):
        return mesh_shape(load_config(None, [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}",
                                             f"mesh.context={context}"]).mesh, devices)

    assert shape(-1, 1, 1, 8) == (8, 1, 1, 1, 1)  # (data, fsdp, expert, context, tensor)
    assert shape(2, -1, 2, 8) == (2, 2, 1, 1, 2)
    assert shape(2, 4, 1, 8) == (2, 4, 1, 1, 1)
    assert shape(2, 1, 1, 8, context=-1) == (2, 1, 1, 4, 1)
    with pytest.raises(ConfigError, match=r"mesh.data=2, mesh.fsdp=2, mesh.expert=1, mesh.context=1, mesh.tensor=1: "
                                          r"data x fsdp x expert x context x tensor = 4, expected the 8"):
        shape(2, 2, 1, 8)
    with pytest.raises(ConfigError, match="do not divide the 8 devices"):
        shape(-1, 3, 1, 8)


def test_tensor_parallel_splits_heads_and_ff_and_fsdp_the_largest_free_dimension():
    mesh = mesh_of(fsdp=2, tensor=4)
    assert param_spec((64, 8, 16), ("embed", "heads", "head_dim"), mesh) == P("fsdp", "tensor", None)
    assert param_spec((8, 16, 64), ("heads", "head_dim", "embed"), mesh) == P("tensor", None, "fsdp")
    assert param_spec((64, 256), ("embed", "ff"), mesh) == P("fsdp", "tensor")
    assert param_spec((256, 64), ("ff", "embed"), mesh) == P("tensor", "fsdp")
    assert param_spec((1000, 64), ("vocab", "embed"), mesh) == P("fsdp", None)  # embeddings: fsdp only
    assert param_spec((64,), ("embed",), mesh) == P("fsdp")
    # Two kv heads cannot be split four ways: that dimension stays whole, fsdp still applies.
    assert param_spec((64, 2, 16), ("embed", "kv_heads", "head_dim"), mesh) == P("fsdp", None, None)
    assert param_spec((63,), ("embed",), mesh) == P(None)  # nothing divides: replicated
    # A head's dimensions stay together, as in the activations: Qwen's biases split over heads, its q/k norms whole.
    assert param_spec((8, 16), ("heads", "head_dim"), mesh) == P("tensor", None)
    assert param_spec((8, 16), ("heads", "head_dim"), mesh_of(fsdp=8)) == P("fsdp", None)
    assert param_spec((2, 16), ("kv_heads", "head_dim"), mesh) == P("fsdp", None)
    assert param_spec((16,), ("head_dim",), mesh) == P(None)
    assert param_spec((4, 16), ("layers", "head_dim"), mesh) == P(None, None)
    # A LoRA adapter lies out as its projection: B of q over heads with wq, A's rank dimension whole.
    assert param_spec((64, 16), ("embed", "lora_rank"), mesh) == P("fsdp", None)
    assert param_spec((16, 128), ("lora_rank", "heads"), mesh) == P(None, "tensor")
    assert param_spec((16, 128), ("lora_rank", "heads"), mesh_of(fsdp=8)) == P(None, "fsdp")
    assert param_spec((64, 8, 16), ("embed", "heads", "head_dim"), mesh_of(data=8)) == P(None, None, None)


def test_distributed_settings_come_from_config_or_environment(monkeypatch):
    dist = load_config(None, []).dist
    monkeypatch.setenv("SEQJAX_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("SEQJAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("SEQJAX_PROCESS_ID", "3")
    assert distributed_settings(dist) == ("10.0.0.1:1234", 4, 3)
    dist = load_config(None, ["dist.process_id=1", "dist.num_processes=4"]).dist
    assert distributed_settings(dist) == ("10.0.0.1:1234", 4, 1)
    monkeypatch.setenv("SEQJAX_PROCESS_ID", "two")
    with pytest.raises(ConfigError, match="SEQJAX_PROCESS_ID='two'"):
        distributed_settings(load_config(None, []).dist)


MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]

SCRIPT = """
import json, sys
from seqjax.main.cli import configure_logging
from seqjax.config.load import load_config
from seqjax.train.loop import train
configure_logging()  # train() logs the mesh line checked below; a library caller chooses where logs go
base = json.loads(sys.argv[1])
for data, fsdp, tensor in json.loads(sys.argv[2]):
    overrides = base + [f"run.dir={sys.argv[3]}/mesh_{data}_{fsdp}_{tensor}",
                        f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"]
    train(load_config(None, overrides))
"""


@pytest.mark.slow
def test_meshes_on_8_devices_match_one_device_and_resume_on_4(reference, tiny_root, tmp_path):
    """Three meshes over 8 forced host devices; then the 8-way data-parallel run continues on 4 devices."""
    steps = 20
    base = [o for o in tiny_overrides(tiny_root, tmp_path, **{"train.steps": steps}) if not o.startswith("run.dir=")]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(base), json.dumps(MESHES), str(tmp_path)],
        cwd=REPO, env=cli_env(devices=8), capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for data, fsdp, tensor in MESHES:
        assert f"mesh {{'data': {data}, 'fsdp': {fsdp}, 'expert': 1, 'context': 1, 'tensor': {tensor}}}" in proc.stderr
        losses = train_losses(tmp_path / f"mesh_{data}_{fsdp}_{tensor}")
        assert sorted(losses) == list(range(1, steps + 1))
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=1e-5), (data, fsdp, tensor, step)

    run_dir = tmp_path / "mesh_8_1_1"
    resumed = run_cli([*base, f"run.dir={run_dir}", "train.steps=30"], devices=4)  # mesh.data=-1: all 4
    assert_ok(resumed)
    elastic = f"elastic resume: checkpoint {steps} was written by 1 process(es) on 8 device(s), now 1 on 4"
    assert elastic in resumed.stderr
    assert "mesh {'data': 4, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}" in resumed.stderr
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), ("resumed on 4 devices", step)


def test_a_mesh_that_does_not_fit_the_devices_stops_the_cli_before_any_data_work(tmp_path, capsys):
    from seqjax.main.train import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"run.dir={tmp_path / 'run'}", "data.dir=/nonexistent", "mesh.data=3"])
    assert exit_info.value.code == 2
    assert (
        "mesh.data=3, mesh.fsdp=1, mesh.expert=1, mesh.context=1, mesh.tensor=1: data x fsdp x expert x context x "
        "tensor = 3, expected the 1 available devices"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


