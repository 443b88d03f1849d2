"""Model state through ``apply_fn``: ``hpf.buffers`` and ``apply_fn(...,
buffers=)`` on a TP model (Colwise → Rowwise → BatchNorm1d, plus a module counting into a
buffer in its forward) at tp 2 and 4, against ``torch.func.functional_call`` of the unsharded
model with the same buffers: loss, every gradient and every buffer after the step, under
``torch.func.grad``, ``.backward()`` and ``vmap``; the caller's tensors untouched; a call without
``buffers=`` as before; save/load and unshard over params and buffers merged; bad buffers named
before any collective.  (torchtitan's MoE token counts: ``tests/models/test_torchtitan.py``.)"""

import pytest
import torch
from torch.func import functional_call, grad_and_value, vmap

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, mesh, world
from tests.support.models import BufferNet

Net = BufferNet


def _model() -> Net:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 1.5)
    return model


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))


def _reference(model: Net, x: torch.Tensor):
    """(loss, grads, buffers after) of the unsharded model through functional_call."""
    params = dict(model.named_parameters())
    state = {k: b.clone() for k, b in model.named_buffers()}

    def loss_of(p, s):
        return functional_call(model, (p, s), (x,)).pow(2).mean()

    grads, loss = grad_and_value(loss_of)(params, state)
    return loss, grads, state  # functional_call updated ``state`` in place


def case_buffers():
    model = _model()
    m = mesh((world(),), ("tp",))
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, example_inputs=(_x(),))
    state, binfo = hpf.buffers(apply_fn)
    assert set(state) == {k for k, _ in model.named_buffers()} == set(binfo), sorted(state)
    assert all(i.global_shape == state[k].shape and not i.is_sharded for k, i in binfo.items())
    before = {k: b.clone() for k, b in state.items()}
    x = _x()
    ref_loss, ref_grads, ref_state = _reference(model, x)
    diffs = {}

    def loss_of(p, s):
        out, after = apply_fn(p, x, buffers=s)
        return out.pow(2).mean(), after

    grads, (loss, after) = grad_and_value(loss_of, has_aux=True)(params, state)
    diffs["loss"] = assert_close(loss, ref_loss, "loss")
    diffs["grad"] = max(assert_close(g, ref_grads[k], f"grad {k}") for k, g in hpf.unshard(grads, info).items())
    diffs["buffers"] = max(assert_close(after[k], ref_state[k], f"buffer {k}") for k in ref_state)
    assert after["norm.num_batches_tracked"].item() == 1 and after["seen.seen"].abs().sum() > 0
    for k, b in before.items():  # the caller's tensors are never written
        assert torch.equal(state[k], b), k
    # .backward(): the same step
    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    out, after_bw = apply_fn(leaves, x, buffers=state)
    out.pow(2).mean().backward()
    diffs["backward"] = max(assert_close(g, ref_grads[k], f"backward grad {k}")
                            for k, g in hpf.unshard({k: p.grad for k, p in leaves.items()}, info).items())
    for k in ref_state:
        assert_close(after_bw[k], ref_state[k], f"backward buffer {k}")
    # two steps thread the state: the second starts from the first's buffers
    _, second = apply_fn(params, x, buffers=after)
    assert second["norm.num_batches_tracked"].item() == 2
    assert_close(second["seen.seen"], 2 * ref_state["seen.seen"], "the counts after two steps")
    # a call without buffers=: the output alone, as before
    assert isinstance(apply_fn(params, x), torch.Tensor)
    # vmap over a batch of inputs, each with its own buffers
    xs = torch.stack([_x(1), _x(2)])
    states = {k: torch.stack([b, b]) for k, b in state.items()}
    outs, afters = vmap(lambda xi, si: apply_fn(params, xi, buffers=si))(xs, states)
    for i in range(2):
        _, _, ref_i = _reference(model, xs[i])
        for k in ref_i:
            assert_close(afters[k][i], ref_i[k], f"vmap {i} buffer {k}")
    return diffs


def test_buffers_through_apply_fn(pool):
    print(f"buffers, tp {pool.world}: {pool.run(case_buffers)[0]}")


def case_checkpoint(path: str):
    """``save``/``load``/``unshard`` take params and buffers merged."""
    model = _model()
    m = mesh((world(),), ("tp",))
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, example_inputs=(_x(),))
    state, binfo = hpf.buffers(apply_fn)
    _, state = apply_fn(params, _x(), buffers=state)
    hpf.save(path, params | state, info | binfo)
    loaded = hpf.load(path, info | binfo)
    full = hpf.unshard(loaded.params, info | binfo)
    for k, b in state.items():
        assert torch.equal(full[k], b), k
    for k, p in model.named_parameters():
        assert torch.equal(full[k], p.detach()), k
    return sorted(state)


def test_buffers_save_load_unshard(tmp_path):
    print(get_pool(2).run(case_checkpoint, str(tmp_path / "ckpt"))[0])


def case_bad_buffers():
    model = _model()
    m = mesh((world(),), ("tp",))
    apply_fn, params, _ = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, example_inputs=(_x(),))
    state, _ = hpf.buffers(apply_fn)
    messages = {}
    for what, bad in {"unknown": {"norm.running_max": state["norm.running_mean"]},
                      "shape": {"norm.running_mean": torch.zeros(3)},
                      "type": [state["norm.running_mean"]]}.items():
        with pytest.raises(hpf.PlanError) as err:
            apply_fn(params, _x(), buffers=bad)
        messages[what] = str(err.value)
    with pytest.raises(hpf.PlanError, match="not one that hpf.shard"):
        hpf.buffers(lambda p: p)
    return messages


def test_bad_buffers_are_named_before_any_collective():
    messages = get_pool(2).run(case_bad_buffers)[0]
    assert "buffers['norm.running_max'] is not a buffer" in messages["unknown"]
    assert "buffers['norm.running_mean'] is ((3,), 'cpu'), expected shape (8,)" in messages["shape"]
    assert "must be a dict" in messages["type"]


# ---------------------------------------------------------------- the skeleton keeps its own buffers
def _shard(model: Net):
    return hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, mesh((world(),), ("tp",)),
                     example_inputs=(_x(),))


def _other(state: dict) -> dict:
    """Buffers unlike the model's: a call with them must not leave them (or their update) behind."""
    return {k: (b + 0.5 if "mean" in k else 2 * b + 1) if b.is_floating_point() else b + 3 for k, b in state.items()}


def case_skeleton_keeps_its_own_buffers() -> dict:
    """After ``apply_fn(params, x, buffers=b)`` (plain and under ``torch.func.grad``) the skeleton
    holds its own buffers again: ``hpf.buffers`` reads the originals back, and in eval mode (the
    output of BatchNorm depends on its running statistics) a later call without ``buffers=``
    equals the unsharded model with its own buffers, not with ``b`` or ``b`` updated."""
    x = _x()
    diffs = {}
    # train mode: the call updates its clone of b; none of it may stay in the skeleton
    apply_fn, params, _ = _shard(_model())
    own, _ = hpf.buffers(apply_fn)
    other = _other(own)
    _, after = apply_fn(params, x, buffers=other)
    assert not torch.equal(after["seen.seen"], own["seen.seen"]), "the call updated its buffers"
    grad_and_value(lambda p, s: (lambda o: (o[0].pow(2).mean(), o[1]))(apply_fn(p, x, buffers=s)),
                   has_aux=True)(params, other)
    for k, b in hpf.buffers(apply_fn)[0].items():
        assert torch.equal(b, own[k]), f"train: the skeleton's {k} is not its own after a call with buffers="
    # eval mode: the output reads the running statistics
    model = _model().eval()
    apply_fn, params, _ = _shard(model)
    own, _ = hpf.buffers(apply_fn)
    other = _other(own)
    ref_other = functional_call(model, (dict(model.named_parameters()), {k: b.clone() for k, b in other.items()}), (x,))
    out_other, _ = apply_fn(params, x, buffers=other)
    diffs["with buffers="] = assert_close(out_other, ref_other, "eval output with other buffers")
    for k, b in hpf.buffers(apply_fn)[0].items():
        assert torch.equal(b, own[k]), f"eval: the skeleton's {k} is not its own after a call with buffers="
    ref = model(x)  # the unsharded model with its own buffers
    assert (ref - ref_other).abs().max() > 0.1, "the buffers must change the output for this check to bite"
    diffs["without buffers="] = assert_close(apply_fn(params, x), ref, "eval output without buffers= after a call with them")
    return diffs


def test_buffers_are_restored_after_a_call_with_buffers():
    print(get_pool(2).run(case_skeleton_keeps_its_own_buffers)[0])


# ---------------------------------------------------------------- in-place updates under torch.func
def case_inplace_update_under_transform() -> dict:
    """An in-place buffer update under ``torch.func.grad``/``vmap`` without ``buffers=`` is a
    ``PlanError`` naming the buffers and the fix (train mode: BatchNorm's statistics; eval mode:
    the counter), the skeleton's buffers untouched; with ``buffers=`` the same calls work, and an
    unrelated error under ``grad`` stays torch's."""
    x, xs = _x(), torch.stack([_x(1), _x(2)])
    messages = {}
    for mode in ("train", "eval"):
        model = getattr(_model(), mode)()
        apply_fn, params, _ = _shard(model)
        own, _ = hpf.buffers(apply_fn)
        calls = {"grad": lambda: torch.func.grad(lambda p: apply_fn(p, x).pow(2).mean())(params),
                 "vmap": lambda: vmap(lambda xi: apply_fn(params, xi))(xs)}
        for transform, call in calls.items():
            with pytest.raises(hpf.PlanError) as err:
                call()
            assert isinstance(err.value.__cause__, RuntimeError), transform
            messages[f"{mode} {transform}"] = str(err.value)
            for k, b in hpf.buffers(apply_fn)[0].items():  # BatchNorm counts the batch before its refused update
                assert torch.equal(b, own[k]) or k.endswith("num_batches_tracked"), f"{mode}: {k} changed by {transform}"
        # the fix the message names: the same calls with buffers=
        ref_loss, _, ref_state = _reference(model, x)
        (loss, after) = grad_and_value(
            lambda p, s: (lambda o: (o[0].pow(2).mean(), o[1]))(apply_fn(p, x, buffers=s)), has_aux=True)(params, own)[1]
        assert_close(loss, ref_loss, f"{mode}: loss with buffers=")
        for k in ref_state:
            assert_close(after[k], ref_state[k], f"{mode}: buffer {k} with buffers=")
        batched = {k: torch.stack([b, b]) for k, b in own.items()}
        _, afters = vmap(lambda xi, si: apply_fn(params, xi, buffers=si))(xs, batched)
        ref_1 = _reference(model, xs[1])[2]
        for k in ref_1:
            assert_close(afters[k][1], ref_1[k], f"{mode}: vmap buffer {k} with buffers=")
    with pytest.raises(RuntimeError) as err:  # not a buffer update: torch's own error
        torch.func.grad(lambda p: apply_fn(p, torch.zeros(6, 5)).sum())(params)
    assert not isinstance(err.value, hpf.PlanError), err.value
    return messages


def test_inplace_buffer_update_under_torch_func_without_buffers_is_a_plan_error():
    for messages in get_pool(2).run(case_inplace_update_under_transform):  # every rank raises alike
        for case, text in messages.items():
            named = "'seen.seen'" if case.startswith("eval") else "'norm.running_mean'"
            assert named in text and "buffers=" in text and "hpf.buffers(apply_fn)" in text, (case, text)
            assert ("vmap" if case.endswith("vmap") else "torch.func.grad") in text, (case, text)


# ---------------------------------------------------------------- a buffer tied between modules
class _Scale(torch.nn.Module):
    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x):
        return x * self.scale


class TiedBuffers(torch.nn.Module):
    """One buffer registered in two modules (as layers share a rotary table): ``hpf.buffers`` keys it
    once, under its first name, and ``buffers=`` binds it in both."""

    def __init__(self):
        super().__init__()
        scale = torch.linspace(0.5, 2.0, 8)
        self.first, self.up, self.down, self.last = _Scale(scale), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), _Scale(scale)

    def forward(self, x):
        return self.last(self.down(torch.relu(self.up(self.first(x)))))


def test_a_tied_buffer_is_bound_in_every_module_that_holds_it():
    """``apply_fn(..., buffers={"first.scale": s})`` computes with ``s`` in both modules that hold the
    buffer, as ``torch.func.functional_call`` does, and not with the model's own in either."""
    torch.manual_seed(0)
    model, x = TiedBuffers(), _x()
    assert model.first.scale is model.last.scale
    other = {"first.scale": torch.linspace(-1.0, 3.0, 8)}
    params = dict(model.named_parameters())
    ref = functional_call(model, (params, {k: v.clone() for k, v in other.items()}), (x,))
    by_hand = model.down(torch.relu(model.up(x * other["first.scale"]))) * other["first.scale"]
    assert_close(ref, by_hand, "functional_call binds the tied buffer in both modules")
    own = model(x)

    def rank(m):
        apply_fn, sharded, _ = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, verify=False)
        assert set(hpf.buffers(apply_fn)[0]) == {"first.scale"}
        out, after = apply_fn(sharded, x, buffers=other)
        return out, after, apply_fn(sharded, x)

    for out, after, without in hpf.emulate(rank, (2,), ("tp",)):
        assert_close(out, ref, "apply_fn with the tied buffer passed")
        assert set(after) == {"first.scale"} and torch.equal(after["first.scale"], other["first.scale"])
        assert_close(without, own, "apply_fn without buffers= after a call with them")
