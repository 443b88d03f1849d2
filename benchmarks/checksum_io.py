"""What checkpoint checksums cost: XXH3-64 throughput, and ``hpf.save`` / ``hpf.load`` with their
checksums against the same calls with hashing switched off, in the same run.

    python benchmarks/checksum_io.py              # world size 2 on CPU/gloo, 0.25 GiB of params + AdamW moments

``save`` hashes every chunk its rank wrote (read back from the page cache) and ``load`` every
chunk it reads, before using it.  "off" replaces the two hash functions the checkpoint code calls
by a constant (everything else identical), so the difference is the hashing alone.  Also prints
the hash rates (XXH3-64, and ``zlib.crc32`` for comparison) on one core.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.cli.launch import run_ranks
from hp_functional.core import checksum
from hp_functional.train import ckpt_integrity

ROWS, COLS, LAYERS = 4096, 4096, 4  # 4 fp32 matrices of 64 MiB: 0.25 GiB of params, 0.75 GiB with AdamW moments


def hash_rates(mib: int = 256) -> dict[str, float]:
    """GB/s of one core over an in-memory buffer, and of ``file_digest`` over a file in the page cache."""
    data = os.urandom(mib << 20)
    out = {}
    for name, fn in (("xxh3_64 (memory)", lambda: checksum.digest(data)), ("zlib.crc32 (memory)", lambda: zlib.crc32(data))):
        fn()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        out[name] = 3 * len(data) / (time.perf_counter() - start) / 1e9
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        checksum.file_digest(f.name)
        start = time.perf_counter()
        checksum.file_digest(f.name)
        out["xxh3_64 (file, page cache)"] = len(data) / (time.perf_counter() - start) / 1e9
    return out


def _switch(on: bool) -> None:
    """Hashing on (the library's functions) or off (a constant, on both the save and the load side)."""
    ckpt_integrity.digest = checksum.digest if on else (lambda data: "0")
    ckpt_integrity.file_digest = checksum.file_digest if on else (lambda path, offset=0, length=None: "0")


def measure(root: str, repeats: int) -> dict[str, list[float]]:
    """Runs on every rank: seconds per save and load, hashing on and off (interleaved)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = torch.nn.Sequential(*(torch.nn.Linear(COLS, ROWS, bias=False) for _ in range(LAYERS)))
    plan = {str(i): hpf.Colwise() if i % 2 == 0 else hpf.Rowwise() for i in range(LAYERS)}
    _, params, info = hpf.shard(model, plan, mesh, verify_values=False)
    state = hpf.optim.adamw(1e-3).init(params)
    times: dict[str, list[float]] = {f"{op} {mode}": [] for op in ("save", "load") for mode in ("on", "off")}
    for i in range(repeats):
        for mode in ("on", "off"):
            _switch(mode == "on")
            path = os.path.join(root, f"ckpt_{mode}_{i}")
            dist.barrier()
            start = time.perf_counter()
            hpf.save(path, params, info, opt_state=state)
            times[f"save {mode}"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            hpf.load(path, info, opt_state=state)
            times[f"load {mode}"].append(time.perf_counter() - start)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
    _switch(True)
    return times


def main() -> None:
    rates = hash_rates()
    root = tempfile.mkdtemp(prefix="hpf_checksum_io_")
    try:
        times = run_ranks(measure, 2, root, 3)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = 3 * ROWS * COLS * LAYERS * 4 / 2**30
    print("hash rate on one core, GB/s:", ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    print(f"hpf.save / hpf.load of {gib:.2f} GiB (params + AdamW moments) at world size 2 (CPU/gloo), median of 3, "
          "checksums on vs off in the same run")
    print(f"{'op':>5} {'on s':>7} {'off s':>7} {'ratio':>6}")
    for op in ("save", "load"):
        on, off = statistics.median(times[f"{op} on"]), statistics.median(times[f"{op} off"])
        print(f"{op:>5} {on:7.2f} {off:7.2f} {on / off:6.2f}x")


if __name__ == "__main__":
    main()
