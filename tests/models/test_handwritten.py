"""A vision transformer written the way timm 1.0.29 writes it (``timm.layers.Attention``, ``Mlp``,
``Block``; a conv patch embedding, a class token, position embeddings), sharded with the hand
plan a timm user writes: the fused ``qkv`` packed in three, ``proj`` rowwise, the head counts
divided, the MLP colwise/rowwise.  Loss and every gradient against the unsharded model at tp 2
and 4, through ``.backward()`` and ``torch.func.grad``, every rank a thread (``hpf.emulate``).
timm itself: ``tests/models/test_timm.py``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hp_functional as hpf
from tests.support.helpers import assert_close


class Attention(nn.Module):
    """timm 1.0.29's ``Attention`` (no qk norm, no gate): the fused ``qkv`` viewed as
    ``(B, N, 3, num_heads, head_dim)``, the output reshaped with ``attn_dim``.  ``width_from_input``:
    timm before 1.0.10, which reshaped with the input's width ``C`` (a number no plan can divide)."""

    def __init__(self, dim: int, num_heads: int, width_from_input: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_dim, self.width_from_input = dim, width_from_input
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C if self.width_from_input else self.attn_dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, width_from_input: bool = False):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, width_from_input)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img: int = 16, patch: int = 4, dim: int = 32, depth: int = 2, heads: int = 4, classes: int = 5,
                 width_from_input: bool = False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, width_from_input) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def hand_plan(heads=("num_heads", "attn_dim")) -> hpf.ShardingPlan:
    """timm's ViT by hand: timm 1.0.29 reshapes with ``num_heads`` and then ``attn_dim``, so both."""
    return hpf.ShardingPlan({
        "blocks.*.attn.qkv": hpf.Colwise(packed=3), "blocks.*.attn.proj": hpf.Rowwise(),
        "blocks.*.attn": hpf.Heads(attrs=heads),
        "blocks.*.mlp.fc1": hpf.Colwise(), "blocks.*.mlp.fc2": hpf.Rowwise(),
    }, axes={"tp": "tp"})


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 16, 16, generator=g), torch.tensor([1, 3])


def _sharded(model, plan, x, y):
    """Per rank: (the loss and full gradients by torch.func.grad, the same by .backward())."""
    def run(mesh):
        apply_fn, params, info = hpf.shard(model, plan, mesh, example_inputs=(x,))
        grads, loss = torch.func.grad_and_value(lambda p: F.cross_entropy(apply_fn(p, x), y))(params)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        eager = F.cross_entropy(apply_fn(leaves, x), y)
        eager.backward()
        by_backward = hpf.unshard({k: v.grad for k, v in leaves.items()}, info)
        return (loss.detach(), hpf.unshard(grads, info)), (eager.detach(), by_backward)
    return run


def check_exact(model: nn.Module, plan, n: int) -> None:
    """The sharded loss and every gradient equal the unsharded model's, on every rank."""
    x, y = _data()
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    for rank in hpf.emulate(_sharded(model, plan, x, y), (n,), ("tp",)):
        for how, (loss, grads) in zip(("torch.func.grad", ".backward()"), rank, strict=True):
            assert_close(loss, ref.detach(), f"tp {n} {how} loss")
            assert grads.keys() == {k for k, _ in model.named_parameters()}
            for k, p in model.named_parameters():
                assert_close(grads[k], p.grad, f"tp {n} {how} grad {k}")


def test_vit_hand_plan_is_exact_at_tp2():
    torch.manual_seed(0)
    check_exact(ViT(), hand_plan(), 2)


@pytest.mark.slow
def test_vit_hand_plan_is_exact_at_tp4():
    torch.manual_seed(0)
    check_exact(ViT(), hand_plan(), 4)


@pytest.mark.parametrize("heads, needle", [
    (("num_heads",), "attn_dim"),  # the last reshape keeps timm 1.0.29's attn_dim global
    (("head_dim", "attn_dim"), "each head's 8 features would be cut to 4"),
], ids=["attn_dim-kept", "head_dim-divided"])
def test_vit_wrong_head_attributes_are_refused(heads, needle):
    torch.manual_seed(0)
    with pytest.raises(hpf.PlanError, match="blocks") as exc:
        hpf.emulate(lambda mesh: hpf.shard(ViT(), hand_plan(heads), mesh, verify=False), (2,), ("tp",))
    assert needle in str(exc.value), exc.value


def test_vit_unpacked_qkv_is_refused():
    """A plain Colwise on the fused qkv gives each rank the same local shapes as packed=3, and the
    wrong rows (rank 0 all of q and half of k at tp 2): refused by the shape audit, the fix named."""
    plan = hand_plan()
    plan = plan.with_entries({**plan.entries, "blocks.*.attn.qkv": hpf.Colwise()})
    with pytest.raises(hpf.PlanError, match="blocks") as exc:
        hpf.emulate(lambda mesh: hpf.shard(ViT(), plan, mesh, verify=False), (2,), ("tp",))
    assert "Colwise(packed=3)" in str(exc.value), exc.value


def test_vit_reshaping_with_the_input_width_is_refused():
    """timm before 1.0.10 reshaped the attention output with the input's width C, which no plan
    divides: refused (not wrong), naming the module."""
    with pytest.raises(hpf.PlanError, match=r"blocks\.\*\.attn.*reshape"):
        hpf.emulate(lambda mesh: hpf.shard(ViT(width_from_input=True), hand_plan(), mesh, verify=False), (2,), ("tp",))
