"""Bridges benchmark: DLPack conversion time 1 MB vs 1 GB (zero-copy: flat), torch DataLoader vs native loader.

Prints one JSON object on its last line (keys and goals in benchmarks/README.md):
- ``zero_copy_1gb_over_1mb``: the larger of the to_torch and to_jax ratios, median time 1 GB / 1 MB (goal < 2);
- ``torch_loader_over_native``: batches/s from a TorchLoader over a DataLoader that fetches whole batches
  (`PermutationBatchSampler` as sampler, ``batch_size=None``, a dataset indexing with ``index_select``) / from
  ``openhosti_jax.data.ArrayDataset``, both shuffled and placed as sharded global batches on 8 devices
  (goal >= 0.9). Also reported: the same with torch's ``BatchSampler(RandomSampler)`` as sampler (every index
  a Python int), with ``TensorDataset`` (list indexing, slow in torch) and with a plain per-sample
  DataLoader (``__getitem__`` per sample + ``default_collate``), and where the time goes, in
  microseconds per batch: the DataLoader iterated bare (``dataloader_us``), the TorchLoader without a mesh
  minus that (``adapter_us``; the adapter drives a single-process loader directly, without the DataLoader's
  iterator), the native source without placement (``native_source_us``), and the placement on the mesh
  (``placement_us``, the same `place_batch` for both).
- ``optimized_ddp_over_torch_ddp_step``: the step time (forward, backward, AdamW) of `OptimizedDDP`'s drop-in mode
  over torch's ``DistributedDataParallel`` (gloo), 2 processes started as torchrun starts them, one CPU device each,
  the same tied-embedding transformer; median over rounds of the ratio within a round (reported; no goal on CPU).
- ``full_mode_over_torch_ddp_step``: the same for `OptimizedDDP`'s full mode (``train_step``: forward, loss, gradient
  and AdamW's optax equivalent as one program, ZeRO-3 over the 2 processes' devices) in the same processes, same
  model and batch, timed in the same rounds (reported).
- ``optimized_ddp_forward_programs_per_step`` (goal 1) and ``optimized_ddp_host_transfers_per_step`` (goal 0): in a
  worker on 8 devices, steady-state drop-in steps of a small MLP whose forward ticks a host callback each time a
  program runs it (over the ticks of one forward alone), and the transfers between host and device, explicit or
  implicit, that JAX's transfer guards (``log_explicit``) log during them.
Runs alternate A and B in one process; loader ratios are medians over rounds of the ratio within a round.

``--quick`` (passed on to the DDP workers): the same 1 MiB and 1 GiB arrays with 5 rounds of 50 conversions, the
loaders over 8,192 rows with 3 rounds of 10 batches, the DDP steps on 8 x 32 tokens in 2 rounds of 2; the same
code paths.
"""

import os

_DEVICES = 1 if os.environ.get("BRIDGES_DDP_WORKER") else 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import goals  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, TensorDataset  # noqa: E402

from openhosti_jax.bridges import PermutationBatchSampler, TorchLoader, to_jax, to_torch  # noqa: E402
from openhosti_jax.data import ArrayDataset  # noqa: E402
from openhosti_jax.sharding import place_batch  # noqa: E402

torch.set_num_threads(1)

# quick: fewer rounds and repetitions, a smaller loader dataset (the same arrays, models and code paths)
CONVERSION = {"rounds": 5, "reps": 50} if goals.QUICK else {"rounds": 15, "reps": 200}
LOADER = {"rounds": 3, "batches": 10, "rows": 8192} if goals.QUICK else {"rounds": 15, "batches": 40, "rows": 32768}
DDP = {"rounds": 2, "steps": 2, "seq": 32} if goals.QUICK else {"rounds": 7, "steps": 10, "seq": 128}
DDP_TIMEOUT_S = 300 if goals.QUICK else 600


class BatchedTensors(Dataset):
    """Map-style dataset whose ``__getitem__`` takes a whole batch of indices (the fast DataLoader pattern).

    The sampler's list of indices goes through numpy: ``torch.as_tensor`` of a 256-int list costs ~45 us, numpy
    ~5 us, and the gather itself ~10 us (as numpy's in the native loader)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, rows: torch.Tensor | list[int]) -> tuple[torch.Tensor, ...]:
        index = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows, dtype=np.int64))
        return tuple(t.index_select(0, index) for t in self.tensors)


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def conversion_ratios(rounds: int = 15, reps: int = 200) -> dict[str, float]:
    small = jax.device_put(np.ones(2**18, np.float32))  # 1 MiB
    large = jax.device_put(np.ones(2**28, np.float32))  # 1 GiB
    small_t, large_t = to_torch(small), to_torch(large)
    assert small_t.data_ptr() == small.unsafe_buffer_pointer() and large_t.data_ptr() == large.unsafe_buffer_pointer()
    assert to_jax(large_t).unsafe_buffer_pointer() == large_t.data_ptr()
    times = {k: [] for k in ("to_torch_1mb", "to_torch_1gb", "to_jax_1mb", "to_jax_1gb")}
    for _ in range(rounds):
        times["to_torch_1mb"].append(_time(lambda: to_torch(small), reps))
        times["to_torch_1gb"].append(_time(lambda: to_torch(large), reps))
        times["to_jax_1mb"].append(_time(lambda: to_jax(small_t), reps))
        times["to_jax_1gb"].append(_time(lambda: to_jax(large_t), reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_1gb = _time(lambda: np.array(large_t.numpy(), copy=True), 2)
    return {
        "to_torch_1gb_over_1mb": med["to_torch_1gb"] / med["to_torch_1mb"],
        "to_jax_1gb_over_1mb": med["to_jax_1gb"] / med["to_jax_1mb"],
        "to_torch_1mb_us": med["to_torch_1mb"] * 1e6,
        "to_jax_1mb_us": med["to_jax_1mb"] * 1e6,
        "host_copy_1gb_over_zero_copy_1gb": copy_1gb / med["to_torch_1gb"],
    }


def loader_ratios(rounds: int = 15, batches: int = 40, rows: int = 32768) -> dict[str, float]:
    n, width, batch = rows, 256, 256
    x = np.random.default_rng(0).normal(size=(n, width)).astype(np.float32)
    y = np.arange(n, dtype=np.int32)
    mesh = jax.make_mesh((8,), ("data",))
    spec = jax.P("data")
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def consume(it) -> float:
        t0 = time.perf_counter()
        for _ in range(batches):
            b = next(it)
            jax.block_until_ready(b)
        return batches / (time.perf_counter() - t0)

    def native():
        return (place_batch(b, mesh, spec) for b in ArrayDataset({"x": x, "y": y}, batch, seed=1))

    def batch_sampler(data: Dataset):
        return BatchSampler(RandomSampler(data, generator=torch.Generator()), batch, drop_last=True)

    def permutation_sampler(data: Dataset):
        return PermutationBatchSampler(len(data), batch, torch.Generator())

    def torch_loader(data: Dataset, sampler=permutation_sampler):
        loader = DataLoader(data, sampler=sampler(data), batch_size=None)
        return TorchLoader(loader, names=("x", "y"), seed=1, mesh=mesh, spec=spec)

    fast = BatchedTensors(torch.from_numpy(x), torch.from_numpy(y))

    def dataloader_bare():
        return iter(DataLoader(fast, sampler=permutation_sampler(fast), batch_size=None))

    def torch_unplaced():
        loader = DataLoader(fast, sampler=permutation_sampler(fast), batch_size=None)
        return TorchLoader(loader, names=("x", "y"), seed=1)

    def torch_per_sample():
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, generator=torch.Generator(), drop_last=True)
        return TorchLoader(loader, names=("x", "y"), seed=1, mesh=mesh, spec=spec)

    makers = {
        "native": native,
        "torch": lambda: torch_loader(fast),
        "torch_batch_sampler": lambda: torch_loader(fast, batch_sampler),
        "torch_tensor_dataset": lambda: torch_loader(dataset, batch_sampler),
        "torch_per_sample": torch_per_sample,
        "dataloader_bare": dataloader_bare,
        "torch_unplaced": torch_unplaced,
        "native_unplaced": lambda: iter(ArrayDataset({"x": x, "y": y}, batch, seed=1)),
    }
    for make in makers.values():  # warm up compiles / caches
        consume(make())
    rates = {k: [] for k in makers}
    for _ in range(rounds):
        for k, make in makers.items():
            rates[k].append(consume(make()))
    med = {k: statistics.median(v) for k, v in rates.items()}

    def over_native(k: str) -> float:  # per round (the two ran back to back), then the median
        return statistics.median(a / b for a, b in zip(rates[k], rates["native"], strict=True))

    return {
        "torch_loader_over_native": over_native("torch"),
        "torch_batch_sampler_loader_over_native": over_native("torch_batch_sampler"),
        "torch_tensor_dataset_loader_over_native": over_native("torch_tensor_dataset"),
        "torch_per_sample_loader_over_native": over_native("torch_per_sample"),
        "native_batches_per_s": med["native"],
        "dataloader_us": 1e6 / med["dataloader_bare"],
        "adapter_us": 1e6 / med["torch_unplaced"] - 1e6 / med["dataloader_bare"],
        "native_source_us": 1e6 / med["native_unplaced"],
        "placement_us": 1e6 / med["native"] - 1e6 / med["native_unplaced"],
        "batch_mb": batch * width * 4 / 2**20,
    }


class _TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.block = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def _ddp_worker(rounds: int = 7, steps: int = 10, seq: int = 128) -> None:
    """One of 2 processes: times torch DDP and OptimizedDDP steps, alternating, and prints the ratios."""
    import torch.distributed as dist

    from openhosti_jax.frontends.torch_ddp import OptimizedDDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = _TinyGPT()
    models = {"torch": torch.nn.parallel.DistributedDataParallel(base), "ours": OptimizedDDP(_TinyGPT())}
    opts = {k: torch.optim.AdamW(m.parameters(), 1e-3) for k, m in models.items()}
    tokens = torch.randint(0, 512, (8, seq))

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 512), targets.reshape(-1))

    full_model = _TinyGPT()
    full = OptimizedDDP(full_model, optimizer=torch.optim.AdamW(full_model.parameters(), 1e-3), criterion=criterion)

    def run(k: str) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            if k == "full":
                full.train_step(tokens, tokens)  # returns the loss as a float tensor: the step has finished
                continue
            opts[k].zero_grad()
            criterion(models[k](tokens), tokens).backward()
            opts[k].step()
        return (time.perf_counter() - t0) / steps

    run("torch"), run("ours"), run("full")  # compile and warm up
    ratios: dict[str, list[float]] = {"ours": [], "full": []}
    for _ in range(rounds):
        torch_s = run("torch")
        for k in ratios:
            ratios[k].append(run(k) / torch_s)
    if dist.get_rank() == 0:
        result = {
            "optimized_ddp_over_torch_ddp_step": statistics.median(ratios["ours"]),
            "full_mode_over_torch_ddp_step": statistics.median(ratios["full"]),
        }
        print("DDP " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def ddp_ratio() -> dict[str, float]:
    """`_ddp_worker` over 2 processes with torchrun's variables."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *(["--quick"] if goals.QUICK else [])],
            env={
                **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                "BRIDGES_DDP_WORKER": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out = [p.communicate(timeout=DDP_TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"the DDP workers ran past {DDP_TIMEOUT_S} s") from None
    line = next((x for x in out[0].splitlines() if x.startswith("DDP ")), None)
    if line is None:
        raise RuntimeError("the DDP workers printed no result:\n" + "\n".join(o[-2000:] for o in out))
    return json.loads(line[4:])


COUNT_STEPS = 4
"""Steady-state drop-in steps whose forward programs and implicit transfers are counted."""


class _Counted(torch.nn.Module):
    """A small MLP whose forward, each time a compiled program runs it, ticks ``runs`` (a host callback)."""

    def __init__(self, runs: list) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.runs = runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchax.interop import call_jax

        def tick(a):
            jax.debug.callback(lambda: self.runs.append(1))
            return a

        return self.net(call_jax(tick, x))


def _count_worker() -> None:
    """Steady-state drop-in steps on 8 devices: forward program runs per step (host-callback ticks over those of
    one forward alone) and the transfers through the host (explicit or implicit; device to device: implicit) that
    JAX's transfer guards log to stderr."""
    from openhosti_jax.bridges.torch_lowering import import_torchax
    from openhosti_jax.frontends.torch_ddp import OptimizedDDP

    import_torchax()
    runs: list = []
    ddp = OptimizedDDP(_Counted(runs))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(32, 16)

    def step() -> None:
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    for _ in range(2):  # compiles
        step()
    jax.effects_barrier()
    start = len(runs)
    with torch.no_grad():  # one forward alone: its ticks (one per device that runs it) are one program run's
        ddp(x)
    jax.effects_barrier()
    ticks_per_forward = len(runs) - start
    before = len(runs)
    print("COUNT-START", file=sys.stderr, flush=True)
    host = ("log_explicit",) * 2  # through the host, explicit or not; device to device, only implicit ones
    with (
        jax.transfer_guard("log"),
        jax.transfer_guard_host_to_device(host[0]),
        jax.transfer_guard_device_to_host(host[1]),
    ):
        for _ in range(COUNT_STEPS):
            step()
        jax.effects_barrier()
    print("COUNT-END", file=sys.stderr, flush=True)
    forwards = (len(runs) - before) / ticks_per_forward
    print("COUNT " + json.dumps({"forward_programs": forwards / COUNT_STEPS}), flush=True)


def dropin_counts() -> dict[str, float]:
    """`optimized_ddp_forward_programs_per_step` and `optimized_ddp_host_transfers_per_step` (every transfer
    between host and device, explicit or implicit, counted from the transfer guards' log) from a worker process,
    so its stderr holds only its own log lines."""
    env = {**os.environ, "BRIDGES_COUNT_WORKER": "1"}
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=DDP_TIMEOUT_S
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("COUNT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"the count worker exited {done.returncode}:\n{done.stderr[-3000:]}")
    log = done.stderr.split("COUNT-START", 1)[-1].split("COUNT-END", 1)[0]
    transfers = sum("transfer:" in x for x in log.splitlines())
    return {
        "optimized_ddp_forward_programs_per_step": json.loads(line[6:])["forward_programs"],
        "optimized_ddp_host_transfers_per_step": transfers / COUNT_STEPS,
    }


def main() -> None:
    conv = conversion_ratios(**CONVERSION)
    result = {
        "zero_copy_1gb_over_1mb": max(conv["to_torch_1gb_over_1mb"], conv["to_jax_1gb_over_1mb"]),
        **conv,
        **loader_ratios(**LOADER),
        **ddp_ratio(),
        **dropin_counts(),
    }
    goals.emit({k: round(v, 4) for k, v in result.items()}, __file__)


if __name__ == "__main__":
    if os.environ.get("BRIDGES_DDP_WORKER"):
        _ddp_worker(**DDP)
    elif os.environ.get("BRIDGES_COUNT_WORKER"):
        _count_worker()
    else:
        main()
