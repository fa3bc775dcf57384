"""TorchLoader and to_global_batch: same batches as numpy slicing, exact resume, same losses as the native loader."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset  # noqa: E402

from openhosti_jax.bridges import TorchLoader, to_global_batch  # noqa: E402
from openhosti_jax.data import ArrayDataset  # noqa: E402
from openhosti_jax.errors import BatchError, BridgeError  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)

N, D = 48, 5
X = np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)
Y = ((X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0.5)).astype(np.int64)  # learnable classes 0..2


def _dataset():
    return TensorDataset(torch.from_numpy(X.copy()), torch.from_numpy(Y.copy()))


def _collect(it, n):
    return [next(it) for _ in range(n)]


def test_in_order_batches_equal_numpy_slices_over_epochs():
    it = TorchLoader(DataLoader(_dataset(), batch_size=8), names=("x", "y"), num_epochs=2)
    batches = list(it)
    assert len(batches) == 2 * N // 8
    for i, b in enumerate(batches):
        rows = slice((i % 6) * 8, (i % 6) * 8 + 8)
        np.testing.assert_array_equal(b["x"], X[rows])
        np.testing.assert_array_equal(b["y"], Y[rows])
        assert b["y"].dtype == np.int64
    assert it.get_state() == {"epoch": 2, "position": 0, "seed": 0}


def test_dict_batches_and_bf16():
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"tokens": torch.full((3,), float(i), dtype=torch.bfloat16), "id": torch.tensor(i)}

    b = next(TorchLoader(DataLoader(Dicts(), batch_size=4)))
    assert b["tokens"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(b["tokens"].astype(np.float32), np.repeat(np.arange(4.0), 3).reshape(4, 3))
    np.testing.assert_array_equal(b["id"], np.arange(4))


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=[pytest.mark.slow, pytest.mark.timeout(180)])])
def test_shuffled_resume_continues_at_the_same_sample(workers):
    def make():
        ctx = "spawn" if workers else None  # fork in a multithreaded JAX process can deadlock
        dl = DataLoader(
            _dataset(),
            batch_size=8,
            shuffle=True,
            generator=torch.Generator(),
            num_workers=workers,
            multiprocessing_context=ctx,
        )
        return TorchLoader(dl, names=("x", "y"), seed=7)

    reference = _collect(make(), 10)  # crosses into the second epoch
    epoch0 = np.concatenate([b["y"] * 0 + np.arange(8) for b in reference[:6]])
    assert epoch0.shape == (N,)
    xs0 = np.concatenate([b["x"] for b in reference[:6]])
    xs1 = np.concatenate([b["x"] for b in reference[6:10]])
    # every sample once per epoch, and the second epoch is not the first one's order
    np.testing.assert_array_equal(np.sort(xs0[:, 0]), np.sort(X[:, 0]))
    assert not np.array_equal(xs0[: len(xs1)], xs1)
    for cut in (3, 6, 7) if workers == 0 else (7,):  # each worker loader spawns a process: keep them few
        first = make()
        _collect(first, cut)
        state = json.loads(json.dumps(first.get_state()))
        resumed = make()
        resumed.set_state(state)
        for want, got in zip(reference[cut:], _collect(resumed, 10 - cut), strict=True):
            np.testing.assert_array_equal(got["x"], want["x"])
            np.testing.assert_array_equal(got["y"], want["y"])


def test_distributed_sampler_set_epoch_resume():
    def make(rank):
        sampler = DistributedSampler(_dataset(), num_replicas=2, rank=rank, shuffle=True, seed=3)
        return TorchLoader(DataLoader(_dataset(), batch_size=4, sampler=sampler), names=("x", "y"))

    ref = _collect(make(0), 9)  # 6 batches per epoch per rank
    other = _collect(make(1), 6)
    seen = np.concatenate([b["x"][:, 0] for b in ref[:6] + other])
    np.testing.assert_array_equal(np.sort(seen), np.sort(X[:, 0]))  # the two ranks partition the epoch
    first = make(0)
    _collect(first, 5)
    resumed = make(0)
    resumed.set_state(first.get_state())
    for want, got in zip(ref[5:], _collect(resumed, 4), strict=True):
        np.testing.assert_array_equal(got["x"], want["x"])


def test_refuses_unreproducible_shuffling_and_bad_batches():
    with pytest.raises(BridgeError, match="RandomSampler without a generator"):
        TorchLoader(DataLoader(_dataset(), batch_size=4, sampler=RandomSampler(_dataset())))
    with pytest.raises(BatchError, match="needs names"):
        next(TorchLoader(DataLoader(_dataset(), batch_size=4)))
    with pytest.raises(BatchError, match="missing"):
        TorchLoader(DataLoader(_dataset(), batch_size=4)).set_state({"epoch": 0})
    resumed = TorchLoader(DataLoader(_dataset(), batch_size=8), names=("x", "y"))
    resumed.set_state({"epoch": 0, "position": 99, "seed": 0})
    with pytest.raises(BatchError, match="has only 6"):
        next(resumed)


def test_to_global_batch_shards_and_checks():
    mesh = jax.make_mesh((8,), ("data",))
    g = to_global_batch({"x": X[:16], "y": Y[:16]}, mesh, jax.P("data"))
    assert g["x"].sharding.spec == jax.P("data") and g["y"].dtype == jnp.int32
    for shard in g["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), X[:16][shard.index])
    np.testing.assert_array_equal(np.asarray(g["y"]), Y[:16])
    with pytest.raises(BatchError, match="not divisible by the 8 shards"):
        to_global_batch({"x": X[:12]}, mesh, jax.P("data"))
    with pytest.raises(BatchError, match="no PartitionSpec for keys"):
        to_global_batch({"x": X[:16], "y": Y[:16]}, mesh, {"x": jax.P("data")})
    with pytest.raises(BridgeError, match="fit int32"):
        to_global_batch({"y": np.full(8, 2**40)}, mesh, jax.P("data"))


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.timeout(120)
def test_training_from_torch_loader_matches_native_loader():
    """An 8-device data-parallel flax/optax run gives the same losses from a DataLoader as from ArrayDataset."""
    mesh = jax.make_mesh((8,), ("data",))
    model, tx = _MLP(), optax.adam(1e-2)
    params = model.init(jax.random.key(0), X[:1])
    replicated = jax.NamedSharding(mesh, jax.P())
    batch_sh = jax.NamedSharding(mesh, jax.P("data"))

    @jax.jit
    def step(params, opt, batch):
        def loss_fn(p):
            logits = model.apply(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    def run(batches):
        p = jax.device_put(params, replicated)
        o = jax.device_put(tx.init(params), replicated)
        losses = []
        for b in batches:
            assert b["x"].sharding == batch_sh
            p, o, loss = step(p, o, b)
            losses.append(float(loss))
        return losses

    native = ArrayDataset({"x": X, "y": Y}, global_batch_size=16, shuffle=False, num_epochs=2)
    native_losses = run(to_global_batch(b, mesh, jax.P("data")) for b in native)
    dl = DataLoader(_dataset(), batch_size=16)
    torch_losses = run(TorchLoader(dl, names=("x", "y"), num_epochs=2, mesh=mesh, spec=jax.P("data")))
    assert len(torch_losses) == 6 and sum(torch_losses[3:]) < sum(torch_losses[:3])
    assert torch_losses == native_losses
