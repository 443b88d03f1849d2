"""``analysis.arguments``: the local version of per-head arguments handed between layers."""

import torch
from torch import nn

from hp_functional.analysis.arguments import head_counts, per_head_arguments


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.head_dim, self.inner = 4, 16, nn.Linear(64, 64)


def test_head_counts_are_the_attributes_that_say_heads():
    assert head_counts(Attention()) == frozenset({4})


def test_per_head_arguments_cut_every_tensor_but_the_hidden_states():
    hidden, bias, mask = torch.empty(2, 8, 64), torch.empty(1, 4, 8, 8), torch.empty(2, 1, 8, 8)
    args, kwargs = per_head_arguments((hidden,), {"position_bias": bias, "mask": mask, "flag": True}, frozenset({4}), 2)
    assert args[0] is hidden and kwargs["mask"] is mask and kwargs["flag"] is True
    assert tuple(kwargs["position_bias"].shape) == (1, 2, 8, 8)
    assert per_head_arguments((hidden,), {"mask": mask}, frozenset({4}), 2) is None
    assert per_head_arguments((hidden, torch.empty(1, 6, 8)), {}, frozenset({6}), 4) is None  # 6 heads do not split
