"""Channel-split convolutions: ``Colwise``/``Rowwise`` on ``nn.Conv2d`` (output / input channels,
dim 1) and ``Channels`` between them (a depthwise convolution, GroupNorm, BatchNorm), against the
unsharded model in one process — output, loss and every gradient under ``.backward()`` and
``torch.func.grad`` — on a hand-written conv MLP and on Hugging Face's ResNet (basic and bottleneck
layers, eval and training mode with its running statistics through ``buffers=``); wrong plans
refused by name at ``shard()``, with and without ``example_inputs``."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.func import functional_call, grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh


class ConvMLP(nn.Module):
    """Conv2d 1x1 → GELU → Conv2d 3x3; ``block=True`` puts a depthwise 3x3 convolution and a
    GroupNorm (per channel, per channel group) between them."""

    def __init__(self, c: int = 4, h: int = 8, block: bool = False, norm_groups: int = 4):
        super().__init__()
        self.up = nn.Conv2d(c, h, 1)
        self.dw = nn.Conv2d(h, h, 3, padding=1, groups=h) if block else None
        self.norm = nn.GroupNorm(norm_groups, h) if block else None
        self.down = nn.Conv2d(h, c, 3, padding=1)

    def forward(self, x):
        h = self.up(x)
        if self.dw is not None:
            h = self.norm(self.dw(h))
        return self.down(nn.functional.gelu(h))


def _grads_match(model, apply_fn, params, info, loss_of_model, loss_of_apply, what: str) -> float:
    """Loss and every gradient of ``apply_fn`` (``.backward()`` and ``torch.func.grad``) against the
    unsharded ``model``'s; the worst gradient difference."""
    model.zero_grad()
    ref = loss_of_model()
    ref.backward()
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = loss_of_apply(leaves)
    loss.backward()
    assert_close(loss, ref.detach(), f"{what} loss")
    worst = 0.0
    for label, grads in (("backward", {k: p.grad for k, p in leaves.items()}),
                         ("grad", grad_and_value(loss_of_apply)(params)[0])):
        full = hpf.unshard(grads, info)
        assert set(full) == {k for k, _ in model.named_parameters()}
        for k, p in model.named_parameters():
            worst = max(worst, assert_close(full[k], p.grad, f"{what} {label} grad {k}", atol=1e-5, rtol=1e-4))
    return worst


def case_conv_mlp(names):
    m = mesh()
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    plans = {
        "pair": (False, {"up": hpf.Colwise(), "down": hpf.Rowwise()}),
        "gather": (False, {"up": hpf.Colwise(gather_output=True)}),
        "split_input": (False, {"down": hpf.Rowwise(input_layout=Replicate())}),
        "block": (True, {"up": hpf.Colwise(), "dw": hpf.Channels(), "norm": hpf.Channels(), "down": hpf.Rowwise()}),
        "channels_gather": (True, {"up": hpf.Colwise(), "dw": hpf.Channels(output_layout=Replicate())}),
    }
    out = {}
    for name in names:
        block, plan = plans[name]
        torch.manual_seed(0)
        model = ConvMLP(block=block)
        apply_fn, params, info = hpf.shard(model, plan, m, example_inputs=x)
        assert apply_fn.runtime.checks["probe"].startswith("exact"), apply_fn.runtime.checks
        assert_close(apply_fn(params, x), model(x).detach(), f"{name} output")
        _grads_match(model, apply_fn, params, info, lambda model=model: model(x).pow(2).mean(),
                     lambda p, f=apply_fn: f(p, x).pow(2).mean(), name)
        out[name] = {k: i.placements for k, i in info.items() if i.is_sharded}
    if "pair" in names:  # DTensor's convolution takes no channel-sharded weight: refused up front, by name
        with pytest.raises(hpf.PlanError, match=r"channel-split modules \['down', 'up'\] have no DTensor rule"):
            hpf.validate_placements(ConvMLP(), plans["pair"][1], m, x)
    if "gather" in names:
        e = hpf.explain(ConvMLP(), plans["pair"][1], m, x.requires_grad_())
        out["collectives"] = (e.schedule.count("all_reduce", "fwd"), e.schedule.count("all_reduce", "bwd"))
    return out


BLOCK = {"up.weight", "up.bias", "dw.weight", "dw.bias", "norm.weight", "norm.bias", "down.weight"}


PAIR = {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),)}


def test_conv_pair_and_block_match_unsharded():
    """The fast guard, at tp 2: Colwise → Rowwise over channels, and with a depthwise convolution and a
    GroupNorm planned Channels between them."""
    got = get_pool(2).run(case_conv_mlp, ["pair", "block"])[0]
    assert got["pair"] == PAIR and set(got["block"]) == BLOCK


@pytest.mark.slow
def test_conv_mlp_matches_unsharded():
    """At tp 4: Colwise → Rowwise over channels, the Colwise output gathered, a Rowwise splitting its
    replicated input, the block with Channels between them, and a Channels output gathered."""
    got = get_pool(4).run(case_conv_mlp, ["pair", "gather", "split_input", "block", "channels_gather"])[0]
    assert got["pair"] == PAIR
    assert got["gather"] == {"up.weight": (Shard(0),), "up.bias": (Shard(0),)}
    assert got["split_input"] == {"down.weight": (Shard(1),)}
    assert set(got["block"]) == BLOCK
    assert set(got["channels_gather"]) == {"up.weight", "up.bias", "dw.weight", "dw.bias"}
    assert got["collectives"] == (1, 1)  # Megatron's pair: one all-reduce forward, one backward


def _resnet(layer_type: str):
    from transformers import ResNetConfig, ResNetForImageClassification

    # the bottleneck's inner width is a quarter of the layer's: 4 and 8 channels, which split at tp 4
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type=layer_type, num_labels=3)
    torch.manual_seed(0)
    model = ResNetForImageClassification(cfg)
    with torch.no_grad():  # statistics and affine parameters away from their init, so that a wrong slice shows
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.uniform_(-0.5, 0.5)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            if "normalization" in name:
                p.uniform_(0.5, 1.5)
    return model


LAYER = "resnet.encoder.stages.*.layers.*.layer"
#: the first conv layer's output channels split, its BatchNorm per channel, the next conv reduces them
RESNET_PLAN = {f"{LAYER}.0.convolution": hpf.Colwise(), f"{LAYER}.0.normalization": hpf.Channels(),
               f"{LAYER}.1.convolution": hpf.Rowwise()}


def case_resnet(layer_type: str):
    m = mesh()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 16, 16, generator=gen), torch.tensor([0, 2])
    model = _resnet(layer_type).eval()
    apply_fn, params, info = hpf.shard(model, RESNET_PLAN, m, example_inputs={"pixel_values": x})
    assert apply_fn.runtime.checks["probe"].startswith("exact"), apply_fn.runtime.checks
    sharded = sorted(k for k, i in info.items() if i.is_sharded)
    worst = {"eval": _grads_match(model, apply_fn, params, info, lambda: model(x, labels=y).loss,
                                  lambda p: apply_fn(p, pixel_values=x, labels=y).loss, "eval")}

    # training mode: batch statistics, and the running statistics updated as the unsharded model does
    model.train()
    apply_fn, params, info = hpf.shard(model, RESNET_PLAN, m, example_inputs={"pixel_values": x})
    state, buffer_info = hpf.buffers(apply_fn)
    assert not any(i.is_sharded for i in buffer_info.values())  # whole on every rank
    ref_state = {k: b.clone() for k, b in model.named_buffers()}

    def ref_loss(p, s):
        return functional_call(model, (p, s), (x,), {"labels": y}).loss

    ref_grads, ref = grad_and_value(ref_loss)(dict(model.named_parameters()), ref_state)  # updates ref_state

    def loss_of(p, s):
        out, after = apply_fn(p, pixel_values=x, labels=y, buffers=s)
        return out.loss, after

    grads, (loss, after) = grad_and_value(loss_of, has_aux=True)(params, state)
    assert_close(loss, ref, "train loss")
    full = hpf.unshard(grads, info)
    worst["train"] = max(assert_close(full[k], g, f"train grad {k}", atol=1e-5, rtol=1e-4) for k, g in ref_grads.items())
    for k, b in ref_state.items():
        assert_close(after[k], b, f"train buffer {k}")
    # .backward() without buffers=: the skeleton's own statistics, updated in place, whole on every rank
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    apply_fn(leaves, pixel_values=x, labels=y).loss.backward()
    own, _ = hpf.buffers(apply_fn)
    for k, b in ref_state.items():
        assert_close(own[k], b, f"train buffer {k} after .backward()")
    backward = hpf.unshard({k: p.grad for k, p in leaves.items()}, info)
    worst["train .backward()"] = max(assert_close(backward[k], g, f"train .backward() grad {k}", atol=1e-5, rtol=1e-4)
                                     for k, g in ref_grads.items())
    # torch.func.grad without a Channels BatchNorm's buffers: its update of captured buffers is refused naming them
    others = {k: b for k, b in state.items() if ".layer.0.normalization." not in k}
    with pytest.raises(hpf.PlanError, match=r"stages\.0\.layers\.0\.layer\.0\.normalization\.running_mean.*buffers=") \
            as err:
        grad_and_value(lambda p: apply_fn(p, pixel_values=x, labels=y, buffers=others)[0].loss)(params)
    return sharded, worst, str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("layer_type", ["basic", "bottleneck"])
def test_hf_resnet_matches_unsharded(pool, layer_type):
    """HF ResNet with each residual layer's first convolution Colwise, its BatchNorm Channels and the
    second convolution Rowwise: eval mode, and training mode with the running statistics."""
    sharded, worst, _ = pool.run(case_resnet, layer_type)[0]
    expected = {f"resnet.encoder.stages.{s}.layers.0.layer.{i}" for s in (0, 1) for i in (0, 1)}
    assert {k.rsplit(".", 2)[0] for k in sharded} == expected, sharded
    assert max(worst.values()) < 1e-4, worst


def _shard_error(model, plan, x, with_inputs: bool) -> str:
    try:
        hpf.shard(model, plan, mesh(), **({"example_inputs": x} if with_inputs else {}))
    except (hpf.PlanError, hpf.ShapeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


class _Scaled(nn.Module):
    """A conv pair with a scalar between them: each rank would compute its share of its gradient."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.down(self.up(x) * self.scale)


class _Centred(nn.Module):
    """A channel mean between the pair: each rank would subtract the mean of its own channels."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = self.norm(self.up(x))
        return self.down(h - h.mean(1, keepdim=True))


def case_refusals(with_inputs: bool):
    torch.manual_seed(0)  # the same weights and batch on every rank
    x = torch.randn(2, 4, 6, 6)
    n = mesh().size()
    found = {}
    bn = nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)).eval()
    found["norm left replicated"] = _shard_error(bn, {"0": hpf.Colwise(), "2": hpf.Rowwise()}, x, with_inputs)
    found["consumer left replicated"] = _shard_error(ConvMLP(), {"up": hpf.Colwise()}, x, with_inputs)
    pair = {"up": hpf.Colwise(), "down": hpf.Rowwise()}
    found["channel mean between"] = _shard_error(_Centred().eval(), {**pair, "norm": hpf.Channels()}, x, with_inputs)
    found["channels do not divide"] = _shard_error(ConvMLP(h=5), pair, x, with_inputs)
    found["groups do not divide"] = _shard_error(  # one group: normalised over every channel
        ConvMLP(block=True, norm_groups=1), {**pair, "dw": hpf.Channels(), "norm": hpf.Channels()}, x, with_inputs)
    scaled = _Scaled()
    if with_inputs:  # traced: the scalar's gradient is reduced
        apply_fn, params, info = hpf.shard(scaled, pair, mesh(), example_inputs=x)
        _grads_match(scaled, apply_fn, params, info, lambda: scaled(x).pow(2).mean(),
                     lambda p: apply_fn(p, x).pow(2).mean(), "scalar between")
        apply_fn, _, _ = hpf.shard(ConvMLP(), pair, mesh(), example_inputs=x[0])
        found["unbatched at shard()"] = apply_fn.runtime.checks["probe"]  # the probe's batch refused: said, not proved
    else:
        found["scalar between"] = _shard_error(scaled, pair, x, with_inputs)
    apply_fn, params, _ = hpf.shard(ConvMLP(), pair, mesh(), **({"example_inputs": x} if with_inputs else
                                                                  {"allow_unproved": True}))
    try:
        apply_fn(params, x[0])  # unbatched (C, H, W): its channels are dim 0
        found["unbatched"] = "accepted"
    except hpf.ShapeError as exc:
        found["unbatched"] = str(exc)
    return n, found


def _check_refusals(n: int, found: dict, with_inputs: bool) -> None:
    norm = found["norm left replicated"]
    assert "PlanError" in norm and "batch_norm" in norm and "Channels()" in norm, norm
    consumer = found["consumer left replicated"]
    assert "PlanError" in consumer and "conv2d" in consumer and "Rowwise()" in consumer, consumer
    mean = found["channel mean between"]
    assert "PlanError" in mean and "op mean" in mean and "whole global one" in mean, mean
    assert (f"up: attribute out_channels=5 is not divisible by mesh axis 'tp' (size {n}); every rank must hold an equal "
            "share") in found["channels do not divide"], found["channels do not divide"]
    assert f"norm: attribute num_groups=1 is not divisible by mesh axis 'tp' (size {n})" in found["groups do not divide"]
    assert "up: input of shape (4, 6, 6) is not batched" in found["unbatched"], found["unbatched"]
    if with_inputs:
        probe = found["unbatched at shard()"]
        assert probe.startswith("skipped: the plan refuses") and "not batched" in probe, probe
    else:
        scalar = found["scalar between"]
        assert "(scale)" in scalar and "example_inputs" in scalar, scalar


def test_wrong_conv_plans_refused_by_name():
    """At tp 2, without a batch to trace: a replicated module reading split channels named with the
    per-channel fix, a replicated scalar between the pair, channel or group counts that do not divide, an
    unbatched input."""
    _check_refusals(*get_pool(2).run(case_refusals, False)[0], with_inputs=False)


@pytest.mark.slow
def test_wrong_conv_plans_refused_with_example_inputs():
    """At tp 4, with example_inputs: the same refusals; the scalar between the pair traced and exact; an
    unbatched batch refused by the probe's run."""
    _check_refusals(*get_pool(4).run(case_refusals, True)[0], with_inputs=True)


@pytest.mark.parametrize("style, module, words", [
    (hpf.Colwise(), nn.Conv2d(4, 8, 3, groups=2), ["blk.conv", "groups=2", "Channels()", "NoParallel()"]),
    (hpf.Rowwise(), nn.Conv1d(4, 8, 3, groups=4), ["blk.conv", "groups=4", "Channels()"]),
    (hpf.Colwise(packed=2), nn.Conv2d(4, 8, 1), ["blk.conv", "packed"]),
    (hpf.Channels(), nn.Conv2d(4, 8, 1), ["blk.conv", "groups=1", "Colwise()", "Rowwise()"]),
    (hpf.Channels(), nn.LayerNorm(8), ["blk.conv", "LayerNorm", "gather_output=True"]),
    (hpf.Channels(), nn.SyncBatchNorm(8), ["blk.conv", "SyncBatchNorm", "forward of its own"]),
    (hpf.Colwise(), nn.ConvTranspose2d(4, 8, 3), ["blk.conv", "ConvTranspose2d"]),
])
def test_style_refuses_by_name(style, module, words):
    """What a style cannot split is refused naming the module and the fix (no ranks needed)."""
    with pytest.raises(hpf.PlanError) as err:
        style.spec(module, "blk.conv", "tp")
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def case_mobilenet_v2():
    from hp_functional.tools.sweep import check_family

    return check_family("mobilenet_v2", mesh())


@pytest.mark.slow
def test_hf_mobilenet_v2_split_convolutions_is_proved_exact():
    """MobileNet-v2 (16 inverted-residual blocks, up to 960 channels) under
    ``auto_plan(split_convolutions=True)``: the shard-time probe's random copy keeps its activations
    at unit scale (a convolution's weights scaled by their whole fan-in), so the plan is proved and
    accepted, and exact against the unsharded HF model (loss and every gradient)."""
    from hp_functional.tools.sweep import EXACT, combine

    row = combine(get_pool(2).run(case_mobilenet_v2))
    assert row["outcome"] == EXACT and row["share"] < 0.65, row
