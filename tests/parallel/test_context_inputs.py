"""Context parallelism for a model without HF's arguments (``hpf.ContextInputs``), on the
torchtitan-style Llama of the tests (``Transformer(tokens, positions=None)``; torchtitan's own
model is tested the same way in ``test_torchtitan.py`` when the package is installed).

cp 2 (ring) and cp 2 × tp 2 (all-gather, torchtitan's sequence-parallel TP plan), with the full
batch and with each rank's chunk (``cp_sharded=True``): the loss ``apply_fn`` returns with
``labels=``, the logits and every gradient against the unsharded model under ``.backward()`` and
``torch.func.grad``; the shard-time probe runs on it.  Bad declarations raise ``PlanError`` on
every rank, naming the argument or the entries."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import assert_close, assert_errors, mesh, plan_errors
from tests.support.titan_llama import VOCAB, Transformer, make_titan_state, titan_tp_plan

SEQ = 16
CP = hpf.ContextInputs(sequence={"tokens": 1}, positions="positions")


def _plan(tp: bool, strategy: str, inputs=CP, attention="layers.*.attention.inner_attention"):
    base = hpf.ShardingPlan.from_torch(titan_tp_plan()) if tp else hpf.ShardingPlan({})
    entries = dict(base.entries)
    if attention == "layers.*.attention":  # torchtitan's per-block entries (exact paths) for the attention's TP input
        style = entries.pop("layers.*.attention")
        entries |= {f"layers.{i}.attention": style for i in range(2)}
    return base.with_entries({**entries, attention: hpf.ContextParallel(strategy)}, axes={**base.axes, "cp": "cp"},
                             settings={**base.settings, "cp_inputs": inputs})


def case_titan_cp(state, tp: bool, strategy: str):
    model = Transformer()
    model.load_state_dict(state)
    m = mesh((2, 2), ("cp", "tp")) if tp else mesh((2,), ("cp",))
    apply_fn, params, info = hpf.shard(model, _plan(tp, strategy), m)
    assert apply_fn.runtime.checks["probe"].startswith("exact"), apply_fn.runtime.checks
    gen = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels[0, :3] = -100  # ignored positions: the mean is over the valid labels of the whole sequence
    logits = model(ids)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref.backward()
    out, loss = apply_fn(params, ids, labels=labels)
    diffs = {"logits": assert_close(hpf.cp_unshard(out, m, 1), logits.detach(), "logits")}
    loss.backward()
    chunk = dict(tokens=hpf.cp_shard(ids, m, 1), labels=hpf.cp_shard(labels, m, 1), cp_sharded=True)
    runs = {"backward": ({k: p.grad for k, p in params.items()}, loss),
            "torch.func": grad_and_value(lambda p: apply_fn(p, ids, labels=labels)[1])(params),
            "cp_sharded": grad_and_value(lambda p: apply_fn(p, **chunk)[1])(params)}
    for label, (grads, value) in runs.items():
        diffs[f"{label} loss"] = assert_close(value, ref.detach(), f"{label} loss")
        full = hpf.unshard(grads, info)
        assert set(full) == {k for k, _ in model.named_parameters()}, "every parameter has a gradient"
        diffs[label] = max(assert_close(full[k], p.grad, f"{label} grad {k}") for k, p in model.named_parameters())
    return diffs


@pytest.mark.parametrize("tp,strategy", [(False, "ring"), (True, "allgather")], ids=["cp2_ring", "cp2_tp2_allgather"])
def test_context_inputs_match_unsharded(tp, strategy):
    print(f"titan-style llama {strategy} {'cp 2 x tp 2' if tp else 'cp 2'}: "
          f"{get_pool(4 if tp else 2).run(case_titan_cp, make_titan_state(), tp, strategy)[0]}")


def case_bad_input():
    torch.manual_seed(0)  # the same weights on every rank
    model = Transformer()
    m = mesh((2, 2), ("cp", "tp"))
    apply_fn, params, _ = hpf.shard(model, _plan(False, "ring"), m, verify=False)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return plan_errors({
        "argument": lambda: hpf.shard(model, _plan(False, "ring", hpf.ContextInputs({"tokens": 1}, "pos")), m),
        "shadowed": lambda: hpf.shard(model, _plan(True, "ring", attention="layers.*.attention"), m),
        "no_positions": lambda: hpf.ContextInputs({"tokens": 1}, None),
        "lengths": lambda: apply_fn(params, ids, positions=torch.arange(SEQ // 2)[None]),
        "shift_sharded": lambda: hpf.shard(model, _plan(False, "ring", hpf.ContextInputs({"tokens": 1}, "positions",
                                                                                         shift=True)), m,
                                           verify=False)[0](params, ids, labels=ids, cp_sharded=True),
    })


def test_bad_context_inputs():
    assert_errors(get_pool(4).run(case_bad_input), {
        "argument": "Transformer.forward has no argument 'pos'",
        "shadowed": "'layers.*.attention' (ContextParallel) loses to the more specific entry",
        "no_positions": "positions must name the forward argument",
        "lengths": "differ in length {'tokens': 16, 'positions': 8}",
        "shift_sharded": "cp_sharded=True and shift=True",
    })
