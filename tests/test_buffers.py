"""Model state through ``apply_fn`` (issue 32 item 1): ``hpf.buffers`` and ``apply_fn(...,
buffers=)`` on a TP model (Colwise → Rowwise → BatchNorm1d, plus a module counting into a
buffer in its forward) at tp 2 and 4, against ``torch.func.functional_call`` of the unsharded
model with the same buffers: loss, every gradient and every buffer after the step, under
``torch.func.grad``, ``.backward()`` and ``vmap``; the caller's tensors untouched; a call without
``buffers=`` as before; save/load and unshard over params and buffers merged; bad buffers named
before any collective.  (torchtitan's MoE token counts: ``tests/test_torchtitan.py``.)"""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

import hp_functional as hpf
from tests.helpers import assert_close, mesh, world


class Seen(nn.Module):
    """Counts what passes through into a buffer, in place (a router's token counts)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("seen", torch.zeros(n))

    def forward(self, x):
        self.seen.add_(x.detach().abs().sum(0))
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.norm, self.seen = nn.BatchNorm1d(8), Seen(8)

    def forward(self, x):
        return self.seen(self.norm(self.down(torch.relu(self.up(x)))))


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
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
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
    apply_fn, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
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
    from tests.conftest import get_pool

    print(get_pool(2).run(case_checkpoint, str(tmp_path / "ckpt"))[0])


def case_bad_buffers():
    model = _model()
    m = mesh((world(),), ("tp",))
    apply_fn, params, _ = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m)
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
    from tests.conftest import get_pool

    messages = get_pool(2).run(case_bad_buffers)[0]
    assert "buffers['norm.running_max'] is not a buffer" in messages["unknown"]
    assert "buffers['norm.running_mean'] is ((3,), 'cpu'), expected shape (8,)" in messages["shape"]
    assert "must be a dict" in messages["type"]
