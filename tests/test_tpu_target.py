"""TPU slices that are not attached, as compile targets: names parsed as Google Cloud counts them, typed errors for
what cannot be one, and (slow suite: libtpu compiles) the library's step compiled for them, its compiled bytes held
to closed forms and the compiler's verdict taken over the prediction."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from openhosti_jax.errors import CompileError, MemoryBudgetError, MeshConfigError, MissingExtraError, PlanningError
from openhosti_jax.mesh import topology
from openhosti_jax.mesh.topology import TpuTarget, libtpu_available, target_mesh, torus_shape, tpu_target
from openhosti_jax.planner.cluster import cluster

needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu (the tpu extra) is not installed")


@pytest.mark.parametrize(
    ("name", "generation", "shape", "slices", "chips"),
    [
        ("v5p-8", "v5p", (2, 2, 1), 1, 4),
        ("v5p-128", "v5p", (4, 4, 4), 1, 64),
        ("v5p-2048", "v5p", (8, 8, 16), 1, 1024),
        ("v4-64", "v4", (2, 4, 4), 1, 32),
        ("v6e-256", "v6e", (16, 16), 1, 256),
        ("v5e-16", "v5e", (4, 4), 1, 16),
        ("2xv5p-256", "v5p", (4, 4, 8), 2, 128),
        ("v5p:4x4x8", "v5p", (4, 4, 8), 1, 128),
        ("4xv6e:8x8", "v6e", (8, 8), 4, 64),
    ],
)
def test_slice_names_parse_as_google_cloud_counts_them(name, generation, shape, slices, chips):
    """v4 and v5p names count TensorCores (two per chip), v5e and v6e chips; the torus is Cloud's for that many."""
    t = tpu_target(name)
    assert (t.generation, t.shape, t.slices, t.chips) == (generation, shape, slices, chips)
    assert math.prod(t.shape) == chips and t.n_devices == chips * slices
    assert tpu_target(t.name) == t  # the canonical name parses back to the same target
    c = cluster(name)  # the planner's cluster reads the same name the same way
    assert (c.hosts, c.devices_per_host, c.profile.name) == (slices, chips, t.profile_name)


def test_tori_double_their_shortest_side():
    for generation, dims in (("v5p", 3), ("v6e", 2)):
        previous = None
        for k in range(2, 11):
            shape = torus_shape(generation, 2**k)
            assert len(shape) == dims and math.prod(shape) == 2**k
            if previous is not None:  # one side doubled
                assert sorted(shape) != sorted(previous)
                assert math.prod(shape) == 2 * math.prod(previous)
            assert max(shape) <= 2 * min(d for d in shape if d > 1)  # as cubic (square) as powers of two allow
            previous = shape


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("v7x-128", "unknown TPU target"),
        ("v5p_128", "unknown TPU target"),
        ("tpu", "unknown TPU target"),
        ("v5p-7", "counts TensorCores, 2 per chip"),
        ("v5p-24", "has no standard shape"),  # 12 chips
        ("v6e-2", "has no standard shape"),
        ("v5p:3x3x3", "does not divide into hosts"),
        ("v6e:4x4x4", "is a 2D torus"),
    ],
)
def test_names_that_are_no_slice_are_typed_errors_naming_the_forms(name, says):
    with pytest.raises(MeshConfigError, match=says):
        tpu_target(name)
    with pytest.raises(PlanningError):  # the planner's cluster says the same, as its own error
        cluster(name)


def test_gpu_cluster_names_still_parse():
    c = cluster("64xH100")
    assert (c.hosts, c.devices_per_host) == (8, 8)


def test_without_libtpu_a_typed_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(topology, "libtpu_available", lambda: False)
    with pytest.raises(MissingExtraError, match=r'pip install "openhosti_jax\[tpu\]"'):
        tpu_target("v5p-8").devices()
    with pytest.raises(MissingExtraError):
        target_mesh("v5p-8", {"fsdp": 4}, ("fsdp",))


def test_a_mesh_that_does_not_cover_the_target_is_a_typed_error():
    with pytest.raises(MeshConfigError, match="spans 8 devices, but the target v5p-8 has 4"):
        target_mesh("v5p-8", {"fsdp": 8}, ("data", "fsdp"))
    assert TpuTarget("v5p", (2, 2, 1)).name == "v5p-8"


# --- compiles for the target (libtpu): the slow suite ------------------------------------------------------------


class _MLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(width, 4 * width, rngs=rngs)
        self.l2 = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multislice_mesh_puts_the_outer_axis_across_slices():
    mesh = target_mesh("2xv5p-16", {"data": 2, "fsdp": 8}, ("data", "fsdp"))
    slices = [[d.slice_index for d in row] for row in mesh.devices]
    assert [set(r) for r in slices] == [{0}, {1}]  # data spans the two slices, fsdp stays inside one


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_state_is_the_zero3_closed_form_and_the_verdict_follows_the_compiler():
    """fsdp=4 ZeRO-3 Adam on 4 v5p chips: the compiled arguments are 12 bytes x parameters / 4 (+ the step count);
    a batch whose activations exceed a chip's 95 GiB is refused by the compiler, and predict reports it not
    fitting whatever the cost model says."""
    from openhosti_jax.planner.predict import predict

    width, rows = 1024, 64
    model = _MLP(width, nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    small = predict(
        model,
        optax.adam(1e-3),
        jax.ShapeDtypeStruct((rows, width), jnp.float32),
        "v5p-8",
        mesh="fsdp=4",
        zero=3,
        precision="fp32",
        compile=True,
    )
    check = small.compiled
    assert check is not None and check.status == "compiled" and small.fits
    state = check.stats["argument"] - rows * width * 4 / 4  # the arguments less the local batch
    assert state == pytest.approx(12 * n_params / 4, rel=0.01)
    assert check.compiled_bytes >= check.stats["argument"]  # the peak holds the arguments
    assert small.as_dict()["verified"] == "compiled for v5p-8"

    huge = predict(
        model,
        optax.adam(1e-3),
        jax.ShapeDtypeStruct((2**25, width), jnp.float32),
        "v5p-8",
        mesh="fsdp=4",
        zero=3,
        precision="fp32",
        compile=True,
        memory_budget=2**50,
    )
    assert huge.compiled.status == "refused: out of memory"
    assert not huge.fits  # a budget of a PiB does not make a refused program fit
    assert huge.compiled.compiled_bytes > 95 * 2**30


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_verify_stage_compiles_for_the_target_until_one_fits():
    """choose_plan on a TPU cluster with compile=True: the winner's compiled bytes fit the chip, the report names
    the target; where every candidate the cost model passes is refused by the compiler, MemoryBudgetError names
    the compiled sizes (a refused plan is never returned)."""
    from openhosti_jax.planner.choose import choose_plan

    model = _MLP(512, nnx.Rngs(0))
    batch = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    plan, report = choose_plan(model, optax.adam(1e-3), batch, cluster="v5p-8", compile=True)
    assert report.compiled_bytes is not None and report.compiled_bytes <= 95 * 2**30
    assert any("compiled for v5p-8" in n for n in report.notes)
    huge = jax.ShapeDtypeStruct((2**26, 512), jnp.float32)  # the cost model is told a PiB fits: the compiler refuses
    with pytest.raises(MemoryBudgetError, match="compiled in rank order"):
        choose_plan(model, optax.adam(1e-3), huge, cluster="v5p-8", compile=True, memory_budget=2**50)
    _, gpu = choose_plan(model, optax.adam(1e-3), batch, cluster="8xH100", compile=True)
    assert gpu.compiled_bytes is None and any("forecast, not compiled" in n for n in gpu.notes)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_the_target_cannot_lower_is_a_compile_error_naming_the_candidate():
    import openhosti_jax as oh
    from openhosti_jax.mesh import MeshConfig, build_mesh

    mesh = build_mesh(MeshConfig(data=8))

    @oh.spmd(mesh=mesh, plan="dp")
    def step(state, batch):
        w = jnp.linalg.eig(state["w"])[0].real.sum()  # no TPU lowering for eig
        return {"w": state["w"] + w}, {"loss": w}

    with pytest.raises(CompileError, match=r"data=4 \(dp\).*v5p-8"):
        step.compile_for("v5p-8", {"w": jnp.eye(4)}, jnp.ones((8, 2)))


@needs_libtpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spmd_step_compile_for_a_target_leaves_the_step_as_it_was():
    import openhosti_jax as oh
    from openhosti_jax.mesh import MeshConfig, build_mesh

    mesh = build_mesh(MeshConfig(fsdp=8))
    state, _ = oh.create_train_state(lambda r: _MLP(256, nnx.Rngs(r)), optax.adam(1e-3), mesh, plan="fsdp")

    @oh.spmd(mesh=mesh, plan="fsdp")
    def step(state, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn(p, batch) ** 2))(state.params)
        return state.apply_gradients(grads=g), {"loss": loss}

    batch = jnp.ones((64, 256))
    check = step.compile_for("v5p-16", state, batch)  # 8 chips: this step's mesh shape
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    assert check.status == "compiled" and check.candidate.startswith("fsdp=8")
    assert check.stats["argument"] >= 12 * n_params / 8
    assert step.plan is None  # nothing planned or compiled for the attached devices
    _, m = step(state, batch)
    assert jnp.isfinite(m["loss"])
