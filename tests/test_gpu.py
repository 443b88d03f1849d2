"""The device paths on one accelerator, at world size 1: every check against the
unsharded model on the same device.

    pytest tests/test_gpu.py --device cuda      # on a GPU (nccl, world size 1); what benchmarks/gpu_check.sh runs
    pytest tests/test_gpu.py --device cpu       # the same tests on the CPU (gloo): they are not broken
    pytest                                      # the default suite: skipped without CUDA ("needs CUDA")

One process, ``init_device_mesh(device, (1,))``: NCCL refuses two ranks on one device, so the
collectives are real but of size 1, and the context-parallel attention kernels run their cp
ranks as threads of this process with the collectives stubbed (an exchange between the threads).
Checked: ``shard``/``apply_fn`` forward and backward, ``torch.func.grad``, activation
checkpointing, ``hpf.fsdp`` with bf16 params and fp32 reduction, the value checksum's device
path, ``from_pretrained`` and meta models read onto the device, ``save``/``load`` of device
tensors, ring and all-gather attention against full-sequence SDPA, ``torch.compile`` with
Inductor.  Nothing here names a device: ``--device`` decides (``tests/conftest.py``)."""

import socket
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.compile.agree import checksum, device_checksum
from hp_functional.core.collectives import AxisGroup
from hp_functional.parallel.context import ring_attention as ring_module
from hp_functional.parallel.context.cp_layout import cp_positions
from hp_functional.parallel.context.ring_attention import RingAttention, allgather_attention
from hp_functional.tools.models import build_model, tiny_config
from tests.conftest import one_device
from tests.support.helpers import assert_close

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def world_of_one(request):
    """A process group of one rank on the device's backend (nccl for cuda, gloo for cpu)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    kind = one_device(request.config, True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank0]:" and never undoes it
    dist.init_process_group(dist.Backend.default_device_backend_map.get(kind, "gloo"),
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    sys.excepthook = hook


def _llama(device: str, **overrides):
    return build_model(tiny_config("llama", attn_implementation="sdpa", **overrides), device=device, seed=0)


def _ids(device: str, batch: int = 2, seq: int = 16):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)


def _reference(model, ids):
    """The unsharded model's loss and gradients (on the same device)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def _compare(loss, grads, info, ref_loss, ref_grads, atol: float = 1e-5) -> float:
    worst = assert_close(loss.detach(), ref_loss, "loss", atol=atol, rtol=atol)
    full = hpf.unshard(grads, info)
    assert full.keys() == ref_grads.keys()
    for k, g in full.items():
        assert g.device.type == ref_grads[k].device.type, k
        worst = max(worst, assert_close(g, ref_grads[k], k, atol=atol, rtol=atol))
    return worst


def test_apply_fn_backward_and_func_grad(device):
    """``shard()`` onto the device (the agreement's value checksums run there too), then
    ``.backward()`` and ``torch.func.grad`` against the unsharded model."""
    model, ids = _llama(device), _ids(device)
    ref_loss, ref_grads = _reference(model, ids)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), init_device_mesh(device, (1,),
                                                                                              mesh_dim_names=("tp",)))
    assert all(p.device.type == device for p in params.values())
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = apply_fn(leaves, input_ids=ids, labels=ids).loss
    loss.backward()
    _compare(loss, {k: p.grad for k, p in leaves.items()}, info, ref_loss, ref_grads)
    grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    _compare(loss, grads, info, ref_loss, ref_grads)


def test_activation_recompute(device):
    model, ids = _llama(device), _ids(device)
    ref_loss, ref_grads = _reference(model, ids)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh, remat=True)
    assert apply_fn.remat_blocks, "no block was recomputed"
    grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    _compare(loss, grads, info, ref_loss, ref_grads)


def test_fsdp_bf16_params_fp32_reduction(device):
    """``hpf.fsdp(param_dtype=bf16, reduce_dtype=fp32)`` against the unsharded model in bf16:
    fp32 master weights and gradients, within bf16's precision."""
    model, ids = _llama(device), _ids(device)
    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("dp", "tp"))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh["tp"])
    apply_fn, params, info = hpf.fsdp(apply_fn, params, info, mesh, "dp", param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32)
    grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    assert all(p.dtype == torch.float32 and grads[k].dtype == torch.float32 for k, p in params.items())
    ref_loss, ref_grads = _reference(model.to(torch.bfloat16), ids)
    assert_close(loss.float(), ref_loss.float(), "bf16 loss", atol=2e-2, rtol=2e-2)
    for k, g in hpf.unshard(grads, info).items():
        scale = ref_grads[k].float().abs().max().item() + 1e-6
        assert (g - ref_grads[k].float()).abs().max().item() <= 0.1 * scale, k


def test_value_checksum_device_path(device):
    """The checksum computed where the bytes live equals the same arithmetic on the host copy,
    and tells a one-bit change apart; ``checksum`` of a device tensor takes that path."""
    x = torch.randn(3 * 4093 + 17, generator=torch.Generator().manual_seed(0))
    on_device = x.to(device)
    for t in (x, x[:5], x.to(torch.bfloat16)):  # a grid and a tail, a short one, 2-byte words
        data = t.contiguous().view(-1).view(torch.uint8)
        assert device_checksum(data.to(device)) == device_checksum(data), t.shape
    flipped = on_device.clone()
    flipped.view(torch.int32)[4093 * 2 + 5] ^= 1
    assert device_checksum(flipped.view(torch.uint8)) != device_checksum(on_device.view(torch.uint8))
    expected = device_checksum(on_device.view(torch.uint8)) if device != "cpu" else checksum(x)
    assert checksum(on_device) == expected


def test_pretrained_and_meta_models_onto_the_device(device, tmp_path):
    """``from_pretrained`` and a meta model with ``weights=`` read a checkpoint onto the device:
    the model's values, and its loss and gradients."""
    model, ids = _llama(device), _ids(device)
    model.save_pretrained(tmp_path)
    ref_loss, ref_grads = _reference(model, ids)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    apply_fn, params, info, _ = hpf.from_pretrained(tmp_path, hpf.ShardingPlan.from_hf(model), mesh)
    assert all(p.device.type == device and torch.equal(p, model.get_parameter(k)) for k, p in params.items())
    grads, loss = torch.func.grad_and_value(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    _compare(loss, grads, info, ref_loss, ref_grads)
    empty = _llama("meta")
    _, loaded, _ = hpf.shard(empty, hpf.ShardingPlan.from_hf(empty), mesh, weights=tmp_path)
    assert all(p.device.type == device and torch.equal(p, params[k]) for k, p in loaded.items())
    _, seeded, _ = hpf.shard(empty, hpf.ShardingPlan.from_hf(empty), mesh, seed=0)  # meta init on the device
    assert all(p.device.type == device and bool(p.isfinite().all()) for p in seeded.values())


def test_save_load_device_tensors(device, tmp_path):
    model = _llama(device)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    _, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
    hpf.save(tmp_path / "ckpt", params, info).wait()
    loaded = hpf.load(tmp_path / "ckpt", info).params
    assert loaded.keys() == params.keys()
    assert all(p.device.type == device and torch.equal(p, params[k]) for k, p in loaded.items())


class _Threads:
    """``cp`` ranks as threads of this process: ``swap`` is their collective (every rank posts
    a tensor and gets every rank's)."""

    def __init__(self, cp: int):
        self.cp, self.posts, self.barrier = cp, [None] * cp, threading.Barrier(cp, timeout=60)

    def swap(self, rank: int, x):
        self.posts[rank] = x
        self.barrier.wait()
        out = list(self.posts)
        self.barrier.wait()
        return out

    def ppermute(self, x, perm, group):
        src = {d: s for s, d in perm}.get(group.rank)
        posts = self.swap(group.rank, x.detach().clone())
        return torch.zeros_like(x) if src is None else posts[src].to(x.device)

    def start_ppermute(self, x, perm, group):
        """``raw_collectives.start_ppermute``: the exchange now, its result at the wait."""
        got = self.ppermute(x, perm, group)
        return lambda: got

    def run(self, fn):
        results, errors = [None] * self.cp, []

        def one(r):
            try:
                results[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.cp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _attention_inputs(device, dtype, cp, kv_heads=2, heads=4):
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, heads), (2, kv_heads), (2, kv_heads), (2, heads)]
    q, k, v, dout = (torch.randn(*s, 8 * cp, 16, generator=gen, dtype=torch.float64).to(device) for s in shapes)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    return (q, k, v, dout), ref.detach(), [t.grad for t in full]


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_kernels_vs_full_sdpa(device, strategy, dtype, monkeypatch):
    """Each cp rank's kernel (zigzag, causal, GQA) on the device against SDPA over the whole
    sequence in fp64: outputs and the gradients of q, k and v.  cp 2, ranks as threads."""
    cp, seq = 2, 16
    (q, k, v, dout), ref, ref_grads = _attention_inputs(device, torch.float64, cp)
    pos = [cp_positions(r, seq, cp, "zigzag", device=device) for r in range(cp)]
    mine = [[t.index_select(2, p).to(dtype) for t in (q, k, v, dout)] for p in pos]
    threads = _Threads(cp)
    group = [AxisGroup("cp", "stub", cp, r) for r in range(cp)]
    if strategy == "ring":  # forward and backward called as functions: no autograd engine across threads
        monkeypatch.setattr(ring_module, "start_ppermute", threads.start_ppermute)
        monkeypatch.setattr(ring_module.C, "ppermute", threads.ppermute)

        def rank(r):
            ql, kl, vl, dl = mine[r]
            out, lse = RingAttention.forward(ql, kl, vl, group[r], "zigzag", True, 16 ** -0.5)
            ctx = SimpleNamespace(saved_tensors=(ql, kl, vl, out, lse), group=group[r], layout="zigzag",
                                  causal=True, scale=16 ** -0.5)
            return (out, *RingAttention.backward(ctx, dl, None)[:3])

        results = threads.run(rank)
    else:  # all-gather: the gathered K/V of every rank stubbed in, its reduce-scatter summed here
        gathered = torch.cat([torch.stack([m[1], m[2]]) for m in mine], 3)
        results, dkv = [], torch.zeros_like(gathered)
        for r in range(cp):
            ql = mine[r][0].clone().requires_grad_()
            kv = gathered.clone().requires_grad_()
            monkeypatch.setattr(ring_module.C, "all_gather", lambda x, dim, g, kv=kv: kv)
            out = allgather_attention(ql, mine[r][1], mine[r][2], group[r], layout="zigzag", causal=True)
            out.backward(mine[r][3])
            dkv += kv.grad
            results.append([out.detach(), ql.grad])
        width = seq // cp
        for r in range(cp):
            results[r] += list(dkv[:, :, :, r * width:(r + 1) * width].unbind(0))
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for i, (name, expected) in enumerate(zip(["output", "dq", "dk", "dv"], [ref, *ref_grads], strict=True)):
        full = torch.empty_like(expected)
        for r in range(cp):
            full[:, :, pos[r]] = results[r][i].to(torch.float64)
        assert_close(full, expected, f"{strategy} {name}", atol=tol, rtol=tol)


def test_compile_inductor(device):
    """``torch.compile(apply_fn)`` with Inductor generating the device's kernels: loss and every
    gradient against the unsharded model."""
    model, ids = _llama(device, num_hidden_layers=1), _ids(device)
    ref_loss, ref_grads = _reference(model, ids)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)
    torch._dynamo.reset()
    compiled = torch.compile(apply_fn, backend="inductor")
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = compiled(leaves, input_ids=ids, labels=ids).loss
    loss.backward()
    _compare(loss, {k: p.grad for k, p in leaves.items()}, info, ref_loss, ref_grads, atol=1e-4)
