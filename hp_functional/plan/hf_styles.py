"""Hugging Face ``tp_plan`` strings → styles (``ShardingPlan.from_hf``); other strings raise
naming the style and the module."""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from .styles import Colwise, NoParallel, Rowwise, SequenceParallel, Style
from .vocab import VocabEmbedding

HF_STYLES: dict[str, Style] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "colwise_gather_output": Colwise(gather_output=True),
    "colwise_rep": Colwise(gather_output=True),
    "rowwise_split_input": Rowwise(input_layout=Replicate()),
    "rowwise_rep": Rowwise(input_layout=Replicate()),
    "replicated_with_grad_allreduce": NoParallel(reduce_grads=True),
    "embedding_rowwise": VocabEmbedding(),
    "packed_colwise": Colwise(packed=2),
    "sequence_parallel": SequenceParallel(),
    "replicate": NoParallel(),
}
