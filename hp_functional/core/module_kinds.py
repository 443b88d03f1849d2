"""What kind of layer a module is, where the answer is not one ``isinstance``: the convolutions
whose channels a plan may split, and Hugging Face's ``Conv1D`` recognised without importing
``transformers``.  Read by the styles that split them and by the compiler's analyses alike."""

from __future__ import annotations

__all__ = ["CONVS", "is_conv1d"]

import torch
from torch import nn

#: the convolutions whose channels ``Colwise``/``Rowwise``/``Channels`` split (transposed ones excluded)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is HF's ``Conv1D`` (GPT-2 family: a Linear whose weight is stored
    transposed, ``[in, out]``, and whose forward reshapes with ``self.nf``); recognised by name
    and shape so that no ``transformers`` import is needed."""
    weight = getattr(module, "weight", None)
    return (any(k.__name__ == "Conv1D" for k in type(module).__mro__) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))
