"""TorchLoader and place_batch: same batches as numpy slicing, exact resume, same losses as the native loader."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset  # noqa: E402

from openhosti_jax.bridges import PermutationBatchSampler, TorchLoader  # noqa: E402
from openhosti_jax.bridges.torch_data import _direct, _samplers, epoch_seed  # noqa: E402
from openhosti_jax.data import ArrayDataset  # noqa: E402
from openhosti_jax.errors import BatchError, BridgeError  # noqa: E402
from openhosti_jax.sharding import place_batch  # noqa: E402

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


class _Counted(torch.utils.data.Dataset):
    """X, Y rows; counts the rows fetched. ``batched``: ``__getitem__`` takes an index tensor/list."""

    def __init__(self, batched=False, getitems=False):
        self.fetched, self.batched = 0, batched
        self.x, self.y = torch.from_numpy(X.copy()), torch.from_numpy(Y.copy())
        if getitems:
            self.__getitems__ = lambda rows: [self[i] for i in rows]

    def __len__(self):
        return N

    def __getitem__(self, i):
        rows = torch.as_tensor(i)
        self.fetched += rows.numel()
        return (self.x[rows], self.y[rows]) if self.batched else {"x": self.x[i], "y": self.y[i]}


_LOADERS = {
    "batch_size": lambda: DataLoader(_Counted(), batch_size=8, shuffle=True, generator=torch.Generator()),
    "last_partial": lambda: DataLoader(_Counted(), batch_size=7, shuffle=True, generator=torch.Generator()),
    "getitems": lambda: DataLoader(_Counted(getitems=True), batch_size=8, shuffle=True, generator=torch.Generator()),
    "collate_fn": lambda: DataLoader(
        _Counted(), batch_size=8, collate_fn=lambda rows: {"x": torch.stack([r["x"] * 2 for r in rows])}
    ),
    "batch_sampler_as_sampler": lambda: DataLoader(
        _Counted(batched=True),
        sampler=BatchSampler(RandomSampler(range(N), generator=torch.Generator()), 8, drop_last=True),
        batch_size=None,
    ),
    "permutation_batches": lambda: DataLoader(
        _Counted(batched=True), sampler=PermutationBatchSampler(N, 8, torch.Generator()), batch_size=None
    ),
}


@pytest.mark.parametrize("kind", sorted(_LOADERS))
def test_direct_single_process_path_yields_the_dataloaders_own_batches(kind):
    """A plain single-process loader is driven through its sampler and dataset directly: the batches equal
    what iterating the DataLoader itself gives for the same generator seed, epoch after epoch."""
    seed, loader = 5, _LOADERS[kind]()
    assert _direct(loader) is not None
    got = TorchLoader(loader, names=("x", "y"), seed=seed)
    per_epoch = len(loader)
    reference = _LOADERS[kind]()
    for epoch in range(2):
        gens = {id(g): g for g in [reference.generator, *(getattr(s, "generator", None) for s in _samplers(reference))]}
        for g in gens.values():
            if g is not None:
                g.manual_seed(epoch_seed(seed, epoch))
        for want in reference:
            have = next(got)
            want = want if isinstance(want, dict) else dict(zip(("x", "y"), want, strict=True))
            assert sorted(have) == sorted(want)
            for k in want:
                np.testing.assert_array_equal(have[k], want[k].numpy())
    assert got.get_state() == {"epoch": 1, "position": per_epoch, "seed": seed}


def test_loaders_with_workers_or_pinned_memory_keep_the_dataloaders_iterator():
    assert _direct(DataLoader(_Counted(), batch_size=8, num_workers=1)) is None
    assert _direct(DataLoader(_Counted(), batch_size=8, pin_memory=True)) is None

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(4))

    assert _direct(DataLoader(Stream(), batch_size=None)) is None


def test_direct_path_resume_skips_indices_without_loading_them():
    def make():
        dl = DataLoader(
            _Counted(batched=True), sampler=PermutationBatchSampler(N, 8, torch.Generator()), batch_size=None
        )
        return TorchLoader(dl, names=("x", "y"), seed=3)

    reference = _collect(make(), 6)
    resumed = make()
    resumed.set_state({"epoch": 0, "position": 4, "seed": 3})
    b4, b5 = _collect(resumed, 2)
    np.testing.assert_array_equal(b4["x"], reference[4]["x"])
    np.testing.assert_array_equal(b5["y"], reference[5]["y"])
    assert resumed.loader.dataset.fetched == 2 * 8  # the 4 skipped batches were never fetched
    # every epoch is a permutation of all rows, and epochs differ
    it = make()
    e0, e1 = _collect(it, 6), _collect(it, 6)
    assert not np.array_equal(e0[0]["x"], e1[0]["x"])
    for epoch in (e0, e1):
        np.testing.assert_array_equal(np.sort(np.concatenate([b["x"][:, 0] for b in epoch])), np.sort(X[:, 0]))


def test_permutation_batch_sampler_sizes_and_errors():
    assert [len(b) for b in PermutationBatchSampler(10, 4, shuffle=False, drop_last=False)] == [4, 4, 2]
    assert torch.cat(list(PermutationBatchSampler(10, 4, shuffle=False))).tolist() == list(range(8))
    assert len(PermutationBatchSampler(10, 4, torch.Generator(), drop_last=False)) == 3
    with pytest.raises(BridgeError, match="needs a torch.Generator"):
        PermutationBatchSampler(10, 4)
    with pytest.raises(BatchError, match="batch_size >= 1"):
        PermutationBatchSampler(10, 0, torch.Generator())


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


def test_place_batch_shards_and_checks():
    mesh = jax.make_mesh((8,), ("data",))
    g = place_batch({"x": X[:16], "y": Y[:16]}, mesh, jax.P("data"))
    assert g["x"].sharding.spec == jax.P("data") and g["y"].dtype == jnp.int32
    for shard in g["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), X[:16][shard.index])
    np.testing.assert_array_equal(np.asarray(g["y"]), Y[:16])
    with pytest.raises(BatchError, match=r"batch\['x'\]: dim 0 of global size 12 is not divisible by the 8 shards"):
        place_batch({"x": X[:12]}, mesh, jax.P("data"))
    with pytest.raises(BatchError, match="no PartitionSpec for batch keys"):
        place_batch({"x": X[:16], "y": Y[:16]}, mesh, {"x": jax.P("data")})
    with pytest.raises(BatchError, match=r"batch\['y'\]: expected int64 values that fit int32"):
        place_batch({"y": np.full(8, 2**40)}, mesh, jax.P("data"))
    on_device = place_batch({"x": jnp.asarray(X[:16])}, mesh, jax.P("data"))  # a device array is resharded
    np.testing.assert_array_equal(np.asarray(on_device["x"]), X[:16])
    assert place_batch(on_device, mesh, jax.P("data"))["x"] is on_device["x"]  # already placed: untouched


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
    native_losses = run(place_batch(b, mesh, jax.P("data")) for b in native)
    dl = DataLoader(_dataset(), batch_size=16)
    torch_losses = run(TorchLoader(dl, names=("x", "y"), num_epochs=2, mesh=mesh, spec=jax.P("data")))
    assert len(torch_losses) == 6 and sum(torch_losses[3:]) < sum(torch_losses[:3])
    assert torch_losses == native_losses
