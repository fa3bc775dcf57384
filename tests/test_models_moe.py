"""The MoE block against independent references: a dense per-token loop written here (dropless and capacity, with
its own capacity counting), the aux losses' closed form on a hand-made routing, and the expert-parallel block on
8 devices against the single-device one (forward, gradients, 3 Adam steps)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from openhosti_jax.errors import BatchError, ConfigError, ShardingError
from openhosti_jax.models.moe import MoEBlock, MoEConfig, expert_parallel, moe_forward, route

TOL = 1e-5
_forward = jax.jit(moe_forward, static_argnums=0)  # eager, each op would compile on its own: slower
_route = jax.jit(route, static_argnums=0)


def _weights(cfg, seed=0):
    """Weights drawn with numpy (no jax compile): a router sharp enough that no two experts tie for a token, and
    experts whose outputs are of order one, so the 1e-5 tolerances below are tight."""
    rs = np.random.default_rng(seed)
    d, f, e, s = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.num_shared_experts * cfg.d_ff
    shapes = {"router": (d, e), "w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
    if s:
        shapes |= {"shared_gate": (d, s), "shared_up": (d, s), "shared_down": (s, d)}
    return {k: jnp.asarray(rs.normal(0.0, 1.0 if k == "router" else 0.5, v), jnp.float32) for k, v in shapes.items()}


def _zeros(cfg):
    """numpy zeros shaped as the block's weights (no computation)."""
    d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
    shapes = {"router": (d, e), "w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
    return {k: np.zeros(v, np.float32) for k, v in shapes.items()}


def _tokens(cfg, shape=(2, 8), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(*shape, cfg.d_model)), jnp.float32)


def _reference_routing(cfg, router, xt):
    """Each token's top-k experts, from numpy: the most probable first (ties are not expected)."""
    probs = np.asarray(jax.nn.softmax(np.asarray(xt) @ np.asarray(router), axis=-1))
    return np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.top_k]


def _reference_kept(cfg, experts):
    """Capacity counting of the reference: tokens in order, each expert full after ``capacity`` assignments."""
    t = experts.shape[0]
    cap = math.ceil(cfg.capacity_factor * t * cfg.top_k / cfg.num_experts)
    used = np.zeros(cfg.num_experts, int)
    kept = np.zeros(experts.shape, bool)
    for i in range(t):
        for j, e in enumerate(experts[i]):
            if used[e] < cap:
                used[e] += 1
                kept[i, j] = True
    return kept


def _reference(cfg, w, x, experts, kept):
    """Dense per-token loop: ``y_t = sum_j p_j / sum p * swiglu_{e_j}(x_t)`` over the token's kept experts, plus the
    shared experts; one plain matmul chain per token and expert (`jax.lax.map` runs the token loop, so that it
    compiles once: no sorting, grouping or scatter as in the block)."""

    def one_token(args):
        x_t, experts_t, kept_t = args
        logits = x_t @ w["router"]
        p = jnp.exp(logits - jnp.max(logits))
        p = p / jnp.sum(p)
        chosen = p[experts_t]
        gates = chosen / jnp.sum(chosen)
        y = jnp.zeros((cfg.d_model,), jnp.float32)
        for j in range(cfg.top_k):
            e = experts_t[j]
            h = jax.nn.silu(x_t @ w["w_gate"][e]) * (x_t @ w["w_up"][e])
            y = y + jnp.where(kept_t[j], gates[j], 0.0) * (h @ w["w_down"][e])
        if cfg.num_shared_experts:
            h = jax.nn.silu(x_t @ w["shared_gate"]) * (x_t @ w["shared_up"])
            y = y + h @ w["shared_down"]
        return y

    xt = x.reshape(-1, cfg.d_model)
    return jax.lax.map(one_token, (xt, jnp.asarray(experts), jnp.asarray(kept))).reshape(x.shape)


def _probe(y):
    """A fixed, non-uniform cotangent so every output element matters to the gradient."""
    return jnp.sin(jnp.arange(y.size, dtype=jnp.float32) * 0.37).reshape(y.shape)


def _assert_trees_close(a, b, tol=TOL):
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, u), v in zip(flat_a, flat_b, strict=True):
        err = float(jnp.max(jnp.abs(u - v)))
        assert err <= tol, f"{jax.tree_util.keystr(path)}: max |difference| {err:.3g} > {tol}"


# --- config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"d_model": 0},
        {"d_ff": -1},
        {"num_experts": 2.0},
        {"top_k": True},
        {"top_k": 5},
        {"num_shared_experts": -1},
        {"capacity_factor": 0.0},
        {"capacity_factor": float("inf")},
        {"capacity_factor": "1.25"},
        {"aux_loss_weight": -0.1},
        {"router_z_loss_weight": float("nan")},
        {"dtype": "int32"},
        {"dtype": "float99"},
    ],
)
def test_bad_config_raises_config_error(bad):
    kw = {"d_model": 8, "d_ff": 16, "num_experts": 4, "top_k": 2, **bad}
    with pytest.raises(ConfigError, match="invalid MoEConfig"):
        MoEConfig(**kw)


def test_capacity_is_ceil_of_factor_times_assignments_per_expert():
    cfg = MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2, capacity_factor=1.25)
    assert cfg.capacity(32) == math.ceil(1.25 * 32 * 2 / 8) == 10
    assert MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2, capacity_factor=0.3).capacity(3) == 1
    assert MoEConfig(d_model=8, d_ff=16, num_experts=2, top_k=2, capacity_factor=8.0).capacity(5) == 5  # <= tokens
    assert MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=2).capacity(32) is None


# --- single device against the dense per-token reference ----------------------------------------------------------


DROPLESS = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2, num_shared_experts=1, router_z_loss_weight=1e-3)
CAPACITY = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2, capacity_factor=0.5)


def _case(cfg, seed):
    """Weights, 16 tokens, the reference's routing and its kept mask (all True when dropless)."""
    w, x = _weights(cfg, seed), _tokens(cfg, seed=seed + 1)
    experts = _reference_routing(cfg, w["router"], x.reshape(-1, cfg.d_model))
    kept = np.ones(experts.shape, bool) if cfg.capacity_factor is None else _reference_kept(cfg, experts)
    return w, x, experts, kept


def test_dropless_equals_per_token_reference():
    cfg = DROPLESS
    w, x, experts, kept = _case(cfg, 0)
    xt = x.reshape(-1, cfg.d_model)
    y, aux = _forward(cfg, w, x)
    assert float(jnp.max(jnp.abs(y))) > 0.5  # outputs of order one: the tolerance means something
    _assert_trees_close(y, _reference(cfg, w, x, experts, kept))
    np.testing.assert_array_equal(np.asarray(_route(cfg, w["router"], xt).experts), experts)
    counts = np.bincount(experts.ravel(), minlength=cfg.num_experts)
    np.testing.assert_array_equal(np.asarray(aux.expert_counts), counts)
    assert float(aux.dropped_fraction) == 0.0
    p_mean = np.asarray(jax.nn.softmax(xt @ w["router"], axis=-1)).mean(0)
    expected_balance = cfg.num_experts * np.sum(counts / experts.size * p_mean)
    assert abs(float(aux.load_balance_loss) - expected_balance) < 1e-6


def test_capacity_drops_exactly_the_reference_drops_and_equals_it_elsewhere():
    cfg = CAPACITY
    w, x, experts, kept = _case(cfg, 2)
    xt = x.reshape(-1, cfg.d_model)
    fully_dropped = ~kept.any(axis=1)
    assert 0 < kept.sum() < kept.size and fully_dropped.any()  # the case exercises drops and whole-token drops

    r = _route(cfg, w["router"], xt)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_array_equal(np.asarray(r.kept), kept)
    y, aux = _forward(cfg, w, x)
    assert abs(float(aux.dropped_fraction) - (~kept).sum() / kept.size) < 1e-7
    np.testing.assert_array_equal(np.asarray(aux.expert_counts), np.bincount(experts.ravel(), minlength=4))
    _assert_trees_close(y, _reference(cfg, w, x, experts, kept))
    assert float(jnp.max(jnp.abs(y.reshape(-1, cfg.d_model)[fully_dropped]))) == 0.0
    assert float(jnp.min(jnp.max(jnp.abs(y.reshape(-1, cfg.d_model)[~fully_dropped]), axis=-1))) > 0.0


@pytest.mark.slow  # ~5 s each on the 2-core machine (two gradient compiles), more under load
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["dropless", "capacity"])
def test_gradients_equal_per_token_reference(case):
    """Gradients w.r.t. every weight and the input, through a fixed non-uniform cotangent."""
    cfg, seed = (DROPLESS, 0) if case == "dropless" else (CAPACITY, 2)
    w, x, experts, kept = _case(cfg, seed)
    probe = _probe(x)

    def loss(fn):
        return lambda w, x: jnp.sum(fn(w, x) * probe)

    grads = jax.jit(jax.grad(loss(lambda w, x: moe_forward(cfg, w, x)[0]), argnums=(0, 1)))(w, x)
    grads_ref = jax.jit(jax.grad(loss(lambda w, x: _reference(cfg, w, x, experts, kept)), argnums=(0, 1)))(w, x)
    assert set(grads[0]) == set(w)
    assert all(float(jnp.max(jnp.abs(g))) > 1e-3 for g in jax.tree.leaves(grads))
    _assert_trees_close(grads, grads_ref)


def test_aux_losses_equal_the_closed_form_on_a_hand_made_routing():
    """Router = identity, so each token's logits are its features: ``log(p) + c`` gives probabilities ``p`` and
    logsumexp ``c``. Top-2 picks {0,1}, {0,1}, {3,2}, {0,3}: counts 3,2,1,2 of 8."""
    probs = np.array([[0.5, 0.25, 0.125, 0.125], [0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.2, 0.3]])
    lse = np.array([1.0, 0.0, 2.0, -1.0])
    x = jnp.asarray(np.log(probs) + lse[:, None], jnp.float32)
    w = {"router": jnp.eye(4), "w_gate": jnp.zeros((4, 4, 2)), "w_up": jnp.zeros((4, 4, 2))}
    w["w_down"] = jnp.zeros((4, 2, 4))
    cfg = MoEConfig(d_model=4, d_ff=2, num_experts=4, top_k=2, aux_loss_weight=0.01, router_z_loss_weight=0.001)

    _, aux = _forward(cfg, w, x)
    f = np.array([3, 2, 1, 2]) / 8
    p_mean = np.array([1.5, 0.8, 0.75, 0.95]) / 4  # column means of probs
    balance = 4 * np.sum(f * p_mean)
    assert balance == pytest.approx(1.09375)
    assert float(aux.load_balance_loss) == pytest.approx(1.09375, abs=1e-6)
    assert float(aux.router_z_loss) == pytest.approx((1 + 0 + 4 + 1) / 4, abs=1e-5)
    assert float(aux.loss) == pytest.approx(0.01 * 1.09375 + 0.001 * 1.5, abs=1e-7)
    np.testing.assert_array_equal(np.asarray(aux.expert_counts), [3, 2, 1, 2])
    r = _route(cfg, w["router"], x)
    np.testing.assert_array_equal(np.asarray(r.experts), [[0, 1], [0, 1], [3, 2], [0, 3]])
    np.testing.assert_allclose(np.asarray(r.weights[0]), [2 / 3, 1 / 3], atol=1e-6)
    np.testing.assert_allclose(np.asarray(r.weights[2]), [4 / 7, 3 / 7], atol=1e-6)

    # capacity ceil(0.5 * 4 * 2 / 4) = 1: expert 0 keeps token 0 (drops 1 and 3), expert 1 token 0 (drops 1),
    # expert 3 token 2 (drops 3), expert 2 token 2: 4 of 8 dropped; counts and the balance loss are pre-drop
    cfg_c = MoEConfig(d_model=4, d_ff=2, num_experts=4, top_k=2, capacity_factor=0.5)
    _, aux_c = _forward(cfg_c, w, x)
    assert float(aux_c.dropped_fraction) == 0.5
    np.testing.assert_array_equal(np.asarray(_route(cfg_c, w["router"], x).kept), [[1, 1], [0, 0], [1, 1], [0, 0]])
    np.testing.assert_array_equal(np.asarray(aux_c.expert_counts), [3, 2, 1, 2])
    assert float(aux_c.load_balance_loss) == pytest.approx(1.09375, abs=1e-6)


def test_block_module_runs_the_functional_forward():
    cfg = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=1, num_shared_experts=2)
    # shapes only (its random init takes seconds to compile; the slow tests and the doctest run it), then numpy weights
    block = nnx.eval_shape(lambda: MoEBlock(cfg, rngs=nnx.Rngs(0)))
    w = _weights(cfg)
    assert {n: getattr(block, n).shape for n in w} == {n: v.shape for n, v in w.items()}
    assert block.shared_gate.shape == (8, 32) and block.w_down.shape == (4, 16, 8)
    for n, v in w.items():
        getattr(block, n).set_value(v)
    x = _tokens(cfg)
    y, aux = nnx.jit(lambda b, x: b(x))(block, x)
    y2, _ = _forward(cfg, block.weights(), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    assert int(aux.expert_counts.sum()) == 16
    with pytest.raises(BatchError, match="d_model=8"):
        block(np.zeros((2, 3, 5), np.float32))


# --- expert parallelism -------------------------------------------------------------------------------------------

MESHES = {
    "expert4_data2": ((2, 4), ("data", "expert"), "data", AxisType.Explicit),
    "expert8": ((8,), ("expert",), None, AxisType.Explicit),
    "expert4_data2_auto": ((2, 4), ("data", "expert"), "data", AxisType.Auto),  # MeshConfig's default axis type
}


def test_expert_axis_that_does_not_divide_num_experts_raises_sharding_error():
    cfg = MoEConfig(d_model=8, d_ff=16, num_experts=6, top_k=2)
    w, x = _zeros(cfg), np.zeros((8, 2, 8), np.float32)  # the checks come before any computation
    with pytest.raises(ShardingError, match="does not divide num_experts=6"):
        expert_parallel(cfg, w, x, jax.make_mesh((2, 4), ("data", "expert")))
    with pytest.raises(ShardingError, match="expected an expert axis"):
        expert_parallel(cfg, w, x, jax.make_mesh((8,), ("data",)))
    with pytest.raises(ShardingError, match="data_axis=None"):
        expert_parallel(cfg, w, x, jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2]))
    cfg4 = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)
    with pytest.raises(BatchError, match="divisible by 8"):
        expert_parallel(cfg4, _zeros(cfg4), np.zeros((4, 2, 8), np.float32), jax.make_mesh((2, 4), ("data", "expert")))


@pytest.mark.slow  # 4-10 s each on the 2-core machine (two shard_map compiles)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_expert_parallel_equals_single_device_forward_and_gradients(mesh_name, capacity_factor):
    shape, names, data_axis, axis_type = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    cfg = MoEConfig(
        d_model=8,
        d_ff=16,
        num_experts=8,
        top_k=2,
        num_shared_experts=1,
        capacity_factor=capacity_factor,
        router_z_loss_weight=1e-3,
    )
    w, x = _weights(cfg), _tokens(cfg, shape=(8, 4))

    def single(w, x):
        return moe_forward(cfg, w, x)

    def parallel(w, x):
        return expert_parallel(cfg, w, x, mesh, data_axis=data_axis)

    assert str(jax.make_jaxpr(parallel)(w, x)).count("all_to_all") >= 2  # tokens do travel to the experts and back
    y, aux = jax.jit(single)(w, x)
    y_ep, aux_ep = jax.jit(parallel)(w, x)
    _assert_trees_close(y_ep, y)
    _assert_trees_close(aux_ep, aux)
    if capacity_factor is not None:
        assert float(aux.dropped_fraction) > 0  # the global capacity is binding, and drops agree

    def loss(fn):
        def f(w, x):
            out, a = fn(w, x)
            return jnp.sum(out * _probe(y)) + a.loss

        return f

    grads = jax.jit(jax.grad(loss(single), argnums=(0, 1)))(w, x)
    grads_ep = jax.jit(jax.grad(loss(parallel), argnums=(0, 1)))(w, x)
    _assert_trees_close(grads_ep, grads)


class _TinyMoELM(nnx.Module):
    """Embedding, one residual MoE block, output head: the smallest model that trains through the block."""

    def __init__(self, cfg: MoEConfig, vocab: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, cfg.d_model, rngs=rngs)
        self.moe = MoEBlock(cfg, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, mesh=None, data_axis=None):
        x = self.embed(tokens)
        y, aux = self.moe(x, mesh, data_axis=data_axis)
        logits = self.head(x + y)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return jnp.mean(nll) + aux.loss


@pytest.mark.slow  # ~10 s on the 2-core machine (two train-step compiles)
@pytest.mark.timeout(300)
def test_three_adam_steps_expert_parallel_match_single_device():
    cfg = MoEConfig(
        d_model=16,
        d_ff=32,
        num_experts=8,
        top_k=2,
        num_shared_experts=1,
        aux_loss_weight=0.1,
        router_z_loss_weight=1e-3,
    )
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)
    tx = optax.adam(1e-2)

    def run(on_mesh):
        graphdef, params = nnx.split(_TinyMoELM(cfg, 32, rngs=nnx.Rngs(0)))

        @jax.jit
        def step(params, opt_state):
            def loss_fn(p):
                return nnx.merge(graphdef, p)(tokens, mesh if on_mesh else None, "data" if on_mesh else None)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        opt_state, losses = tx.init(params), []
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
        return losses

    single, parallel = run(False), run(True)
    assert single[2] < single[0]  # it trains
    np.testing.assert_allclose(parallel, single, atol=TOL, rtol=0)
