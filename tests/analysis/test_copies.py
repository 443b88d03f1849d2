"""``analysis.copies``: the analyses' private copies read the user's module and inputs only."""

import torch
from torch import nn

from hp_functional.analysis.copies import meta_copy, snapshot, to_meta


def test_meta_copy_reads_the_module_only_and_drops_the_users_hooks():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    seen = []
    model.register_forward_hook(lambda m, a, o: seen.append(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = meta_copy(model, shapes={"0.weight": torch.Size([2, 4])})
    assert twin[0].weight.device.type == "meta" and twin[0].weight.shape == (2, 4) and twin[1].weight.shape == (4, 8)
    assert not twin._forward_hooks and model._forward_hooks  # the copy runs no hook of the user's
    valued = meta_copy(model, device="cpu", values=True)
    assert torch.equal(valued[0].weight, model[0].weight) and valued[0].weight is not model[0].weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_inputs_move_to_meta_or_keep_their_values_and_snapshots_are_new():
    x = {"ids": torch.arange(6).view(2, 3), "rest": (torch.ones(2), 3)}
    meta = to_meta(x)
    assert meta["ids"].device.type == "meta" and meta["ids"].shape == (2, 3) and meta["rest"][1] == 3
    valued = to_meta(x, "cpu", values=True)
    assert torch.equal(valued["ids"], x["ids"]) and valued["ids"] is not x["ids"]
    args = (torch.empty(2, 3, device="meta"),)
    copied = snapshot(args)
    assert copied[0] is not args[0] and copied[0].shape == (2, 3) and copied[0].device.type == "meta"
