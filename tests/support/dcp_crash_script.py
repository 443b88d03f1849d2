"""Run by tests/train/test_dcp.py under ``torchrun --nproc-per-node 2``: save checkpoint A completely,
then start checkpoint B and kill rank 1 half-way through writing its data file."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.train import dcp
from tests.support.models import MLP, PLANS, make_mlp_state


def main(root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = MLP()
    model.load_state_dict(make_mlp_state())
    _, params, info = hpf.shard(model, PLANS["tp"], mesh)
    dcp.save(os.path.join(root, "A"), params, info, extra={"step": 1})
    if dist.get_rank() == 1:

        def crash(self, plan, planner):  # half a shard on disk, then the rank dies
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(b"half a shard")
                f.flush()
            os._exit(1)

        FileSystemWriter.write_data = crash
    dcp.save(os.path.join(root, "B"), {k: p + 1 for k, p in params.items()}, info, extra={"step": 2})


if __name__ == "__main__":
    main(sys.argv[1])
