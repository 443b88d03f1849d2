"""A deep record of everything a user owns in a model, to prove shard()/apply_fn mutate nothing."""

import torch
from torch import nn

_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
_PLAIN = (int, float, str, bool, type(None), tuple)


def snapshot(model: nn.Module) -> dict:
    return {
        "params": [
            (n, id(p), p.data_ptr(), p.detach().clone(), p.requires_grad, p.grad)
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [(n, id(b), b.data_ptr(), b.clone()) for n, b in model.named_buffers(remove_duplicate=False)],
        "modules": [
            (
                n, id(m), type(m), sorted(m.__dict__),
                m.__dict__.get("forward"),
                {h: [(k, id(f)) for k, f in getattr(m, h).items()] for h in _HOOKS if hasattr(m, h)},
                {k: v for k, v in m.__dict__.items() if isinstance(v, _PLAIN)},
                m.training,
            )
            for n, m in model.named_modules(remove_duplicate=False)
        ],
        "config": model.config.to_dict() if hasattr(model, "config") else None,
        "config_id": id(getattr(model, "config", None)),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert [x[:3] for x in before["params"]] == [x[:3] for x in after["params"]], "parameter objects/storage changed"
    for (n, *_, v0, rg0, g0), (_, *_, v1, rg1, g1) in zip(before["params"], after["params"], strict=True):
        assert torch.equal(v0, v1), f"parameter {n} values changed"
        assert rg0 == rg1, f"parameter {n} requires_grad changed"
        assert g0 is None and g1 is None, f"parameter {n} got a .grad"
    assert [x[:3] for x in before["buffers"]] == [x[:3] for x in after["buffers"]], "buffer objects changed"
    for (n, *_, v0), (_, *_, v1) in zip(before["buffers"], after["buffers"], strict=True):
        assert torch.equal(v0, v1), f"buffer {n} changed"
    assert before["modules"] == after["modules"], "module attributes, forward or hooks changed"
    assert before["config"] == after["config"] and before["config_id"] == after["config_id"], "config changed"
