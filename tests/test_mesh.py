"""MeshConfig resolution and validation, build_mesh, distributed init no-op."""

import jax
import pytest

from openhosti_jax.errors import DistributedError, MeshConfigError
from openhosti_jax.mesh import AXES, MeshConfig, build_mesh, initialize_distributed, mesh_sizes


def test_resolve_infers_the_open_axis():
    assert MeshConfig(data=-1, fsdp=2).resolve(8) == {
        "stage": 1,
        "data": 4,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }
    assert MeshConfig(stage=2, data=2, fsdp=-1, tensor=1).resolve(8)["fsdp"] == 2


def test_product_mismatch_is_a_typed_error_with_the_fix():
    with pytest.raises(MeshConfigError, match="multiply to 3 but there are 8 devices"):
        MeshConfig(data=3).resolve(8)
    with pytest.raises(MeshConfigError, match="does not divide"):
        MeshConfig(data=-1, fsdp=3).resolve(8)
    with pytest.raises(ValueError, match="more than one axis set to -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(MeshConfigError, match="expected a positive int"):
        MeshConfig(tensor=0)
    with pytest.raises(MeshConfigError, match="without the planner"):
        MeshConfig(data="auto", fsdp="auto").resolve(8)


def test_build_mesh_axes_and_devices():
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    assert mesh.axis_names == AXES
    assert mesh_sizes(mesh) == {"stage": 1, "data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    sub = build_mesh(MeshConfig(data=-1), devices=jax.devices()[:4])
    assert mesh_sizes(sub)["data"] == 4


def test_hybrid_mesh_checks_the_dcn_factor():
    # one process, no slices: a DCN factor of 2 cannot be laid out
    with pytest.raises(MeshConfigError, match="dcn factors"):
        build_mesh(MeshConfig(data=-1, dcn={"data": 2}))
    with pytest.raises(MeshConfigError, match="not one of"):
        MeshConfig(dcn={"batch": 2})


def test_explicit_axis_types():
    mesh = build_mesh(MeshConfig(data=-1, axis_type="explicit"))
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def test_initialize_distributed_single_process_is_a_noop(monkeypatch):
    for k in ("SLURM_JOB_ID", "OPENHOSTI_COORDINATOR", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(k, raising=False)
    assert initialize_distributed() is False
    monkeypatch.setenv("OPENHOSTI_COORDINATOR", "127.0.0.1:1")
    with pytest.raises(DistributedError, match="num_processes"):
        initialize_distributed()


def test_torchrun_environment_starts_jax_distributed(monkeypatch):
    """torchrun's variables become the coordinator (MASTER_PORT + 1), process count and id."""
    from openhosti_jax.mesh import distributed

    for k in ("SLURM_JOB_ID", "OPENHOSTI_COORDINATOR", "OPENHOSTI_NUM_PROCESSES", "OPENHOSTI_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(distributed, "_is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    assert initialize_distributed() is True
    assert (seen["coordinator_address"], seen["num_processes"], seen["process_id"]) == ("127.0.0.1:29501", 2, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert initialize_distributed() is False  # torchrun with one worker: a single process
