"""A model whose own code recomputes modules in the backward (a custom ``autograd.Function`` that
calls modules, ``torch.utils.checkpoint`` in its forward, Reformer's reversible layers) reads their
parameters after ``apply_fn`` has returned: found at shard time (``analysis.recompute``) and refused
by name whenever ``apply_fn`` runs with a gradient, on every rank; without a gradient it runs exact.
Hugging Face's own checkpointing (turned off on the skeleton) is not counted."""

import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hp_functional as hpf
from hp_functional.analysis.recompute import watch_recomputed
from tests.conftest import get_pool
from tests.support.helpers import mesh, raised
from tests.support.models import build_llama, make_llama_state


class _Rerun(torch.autograd.Function):
    """Runs ``block`` without a graph; its backward would re-run it (Reformer's pattern)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        return block(x)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs the forward only
        raise NotImplementedError


class _Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.inner, self.out = how, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if self.how == "function":
            x = _Rerun.apply(x, self.inner)
        elif self.how in ("reentrant", "non-reentrant"):
            x = checkpoint(self.inner, x, use_reentrant=self.how == "reentrant")
        else:
            x = self.inner(x)
        return self.out(x)


def _found(model: nn.Module, *args, **kwargs) -> dict[str, str]:
    found, remove = watch_recomputed(model)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own: a checkpoint whose inputs need no gradient
            model(*args, **kwargs)
    finally:
        remove()
    return found


def test_the_models_own_recompute_is_found_by_module():
    x = torch.randn(2, 8)
    assert _found(_Model("function"), x) == {"inner": f"{__name__}._Rerun"}
    assert _found(_Model("reentrant"), x) == {"inner": "torch.utils.checkpoint.checkpoint"}
    assert _found(_Model("non-reentrant"), x) == {"inner": "torch.utils.checkpoint.checkpoint"}
    assert _found(_Model("plain"), x) == {}


def test_hugging_face_checkpointing_is_not_counted():
    """HF checkpoints only where a gradient is taken (and ``shard()`` turns it off on the skeleton)."""
    for reentrant in (True, False):
        hf = build_llama(make_llama_state()).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        ids = torch.randint(0, 128, (2, 8))
        assert _found(hf, input_ids=ids) == {}


def case_reformer():
    from hp_functional.tools.sweep import build

    model, inputs, _, _ = build("reformer", 2)
    model.eval()  # its dropout off: the forward compared below draws nothing
    apply_fn, params, _ = hpf.shard(model, hpf.auto_plan(model, mesh(), example_inputs=inputs), mesh(),
                                    example_inputs=inputs)
    refused = raised(apply_fn, params, **inputs)
    with torch.no_grad():
        got, want = apply_fn(params, **inputs).logits, model(**inputs).logits
    return refused, (got - want).abs().max().item()


def test_reformer_is_refused_with_a_gradient_and_exact_without():
    for refused, diff in get_pool(2).run(case_reformer):
        assert refused is not None and refused[0] == "PlanError", refused
        assert "reformer.encoder.layers.0" in refused[1] and "_ReversibleFunction" in refused[1], refused
        assert "torch.no_grad()" in refused[1], refused
        assert diff < 1e-5, diff
