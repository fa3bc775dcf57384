"""Host-local data: each device's samples come by index from the source, each sample once per epoch, resumable."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import openhosti_jax as oh
from openhosti_jax.balance import Balancer, HostLocalData, Throttle
from openhosti_jax.data import ArrayDataset, StatefulIterator
from openhosti_jax.errors import BalanceError, BatchError

N, B, M, D = 200, 48, 12, 8  # samples, global batch, microbatches per step, features


def arrays():
    r = np.random.default_rng(0)
    return {"x": r.normal(size=(N, D)).astype(np.float32), "id": np.arange(N, dtype=np.int32)}


def loss_sum_fn(p, mb, rng):
    return jnp.sum(jnp.tanh(mb["x"] @ p["w"]) ** 2), jnp.float32(mb["x"].shape[0])


def used_ids(buffer, counts, slots):
    """Per data position, the sample ids of the microbatches it runs (read back from its own shard)."""
    out = {}
    for shard in buffer["id"].addressable_shards:
        pos = (shard.index[0].start or 0) // slots
        out[pos] = np.asarray(shard.data)[: counts[pos]].ravel().tolist()
    return out


def test_every_sample_is_used_once_per_epoch_with_a_straggler_and_each_read_once():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    source = ArrayDataset(arrays(), global_batch_size=B)
    data = HostLocalData(source, B, microbatches=M, seed=5, record_ids=True)
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(D, D)), jnp.float32) * 0.3}
    straggler = Throttle.for_devices(4, {3: 4}, microbatch_seconds=0.01)  # device 3 is 4x slower
    bal = Balancer(loss_sum_fn, mesh, total=M, every=1, throttle=straggler)
    seen, per_device, rng = collections.Counter(), np.zeros(4, int), jax.random.key(0)
    for _ in range(data.steps_per_epoch):
        batch, counts, slots = next(data), bal.counts, bal.buffer_slots()
        buffer = batch.place(counts, slots, mesh)
        for pos, ids in used_ids(buffer, counts, slots).items():
            seen.update(ids)
            per_device[pos] += len(ids)
        loss, g, n = bal.run(params, buffer, rng)
    epoch = data.epoch_order(0)[: data.steps_per_epoch * B]
    assert sorted(seen) == sorted(epoch.tolist()) and set(seen.values()) == {1}  # each sample exactly once
    assert per_device[3] < per_device[:3].min(), per_device  # the straggler ran fewer samples
    assert sorted(data.ids_read) == sorted(epoch.tolist())  # read once each, only what ran
    assert data.bytes_read == len(epoch) * (D * 4 + 4)
    # the last step's gradient is the plain full-batch mean over its samples
    x = arrays()["x"][batch.sample_ids.ravel()]
    ref_loss, ref_g = jax.value_and_grad(lambda p: loss_sum_fn(p, {"x": x}, None)[0] / B)(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g["w"]), np.asarray(ref_g["w"]), rtol=1e-5, atol=1e-6)


def test_the_position_resumes_exactly_after_a_restart_with_a_different_assignment():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def run(data, counts, steps):
        slots = max(counts)
        return [
            sorted(sum(used_ids(next(data).place(counts, slots, mesh), counts, slots).values(), []))
            for _ in range(steps)
        ]

    straight = run(HostLocalData(arrays(), B, microbatches=M, seed=2), (3, 3, 3, 3), 6)
    first = HostLocalData(arrays(), B, microbatches=M, seed=2)
    before = run(first, (3, 3, 3, 3), 2)
    state = first.get_state()
    again = HostLocalData(arrays(), B, microbatches=M, seed=0)  # the saved seed wins
    again.set_state(state)
    after = run(again, (6, 4, 2, 0), 4)  # 4 steps: through the end of epoch 0 into epoch 1
    assert before + after == straight
    assert isinstance(again, StatefulIterator)  # a checkpoint stores its position like any data source's
    assert again.get_state() == {"epoch": 1, "position": 2, "seed": 2, "global_batch_size": B}
    with pytest.raises(BatchError, match="global_batch_size 24"):
        HostLocalData(arrays(), 24, microbatches=M).set_state(state)


@pytest.mark.torch
def test_torch_and_grain_map_datasets_are_read_by_index():
    torch = pytest.importorskip("torch")
    a = arrays()
    ds = torch.utils.data.TensorDataset(torch.from_numpy(a["x"]), torch.from_numpy(a["id"]))
    batch = next(HostLocalData(ds, B, microbatches=M, seed=3))
    mb = batch.microbatch(2)
    np.testing.assert_array_equal(mb[1], batch.sample_ids[2])
    np.testing.assert_array_equal(mb[0], a["x"][batch.sample_ids[2]])
    grain = pytest.importorskip("grain")
    gds = grain.MapDataset.source(list(range(N))).map(lambda i: {"x": a["x"][i], "id": a["id"][i]})
    gbatch = next(HostLocalData(gds, B, microbatches=M, seed=3))
    np.testing.assert_array_equal(gbatch.sample_ids, batch.sample_ids)  # the order depends on the seed only
    np.testing.assert_array_equal(gbatch.microbatch(5)["x"], a["x"][gbatch.sample_ids[5]])


def test_sources_that_cannot_be_indexed_and_too_small_batches_are_refused():
    for source in (iter(range(100)), (i for i in range(100))):
        with pytest.raises(BatchError, match="cannot be indexed"):
            HostLocalData(source, 8, microbatches=4)
    with pytest.raises(BatchError, match="divisible by microbatches"):
        HostLocalData(arrays(), 10, microbatches=4)
    mesh = oh.build_mesh(oh.MeshConfig(data=8))
    state, plan = oh.create_train_state(lambda _: {"w": jnp.ones((D, D))}, optax.sgd(0.1), mesh, plan="dp")
    step = oh.balanced_step(loss_sum_fn, mesh=mesh, plan=plan, microbatches=4)
    with pytest.raises(BalanceError, match="fewer than the 8 balanced devices"):
        step(state, next(HostLocalData(arrays(), 4, microbatches=4)))


@pytest.mark.torch
def test_a_torch_iterable_dataset_is_refused():
    torch = pytest.importorskip("torch")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(BatchError, match="cannot be indexed"):
        HostLocalData(Stream(), 8, microbatches=4)
