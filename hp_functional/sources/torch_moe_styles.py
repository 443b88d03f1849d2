"""torchtitan's ``ParallelStyle`` subclasses as plan values, recognised by what they are.

torchtitan's styles (``NoParallel``, and for the routed experts ``TensorParallel``,
``ExpertParallel`` and ``ExpertTensorParallel``) live in torchtitan, which this library does not
import, so they are matched by the shape of their class — names in its MRO, the attributes and
hooks the style has — never by identity (``behaviour_style``).  See
docs/torchtitan.md#what-from_torch-recognises.
"""

from __future__ import annotations

__all__ = ["behaviour_style"]

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from ..core.errors import PlanError
from ..core.style import ModuleSpec, Style
from ..parallel.experts.calls import ExpertsCall, experts_call
from ..parallel.experts.styles import Experts, expert_weights
from ..parallel.tensor.styles import PrepareInput, PrepareOutput

#: torchtitan styles refused by name, with what to plan instead.
_REFUSED = {
    "DeepEPExpertParallel": "DeepEP's kernels are CUDA-only; plan the experts as hpf.Experts() (ExpertParallel)",
    "ReordererSequenceParallel": "EP borrowing the TP ranks (expert_tensor_parallel_degree=1 with tp) has no "
                                 "counterpart; set expert_tensor_parallel_degree to the tp degree (ExpertTensorParallel) "
                                 "or plan hpf.Experts() on an ep axis of its own",
    "DualPipeExpertParallel": "DualPipeV's overlapped dispatch has no counterpart; plan the wrapped style itself",
}


@dataclass(frozen=True)
class ExpertsTP(Style):
    """TP inside every routed expert, no EP (torchtitan's MoE ``TensorParallel``): the stacked
    weights sharded over the axis per the calling convention, the tokens replicated, the output
    a partial sum (reduced by the enclosing block's output layout)."""

    call: str | ExpertsCall | None = None
    axis: str | None = None

    def spec(self, module: nn.Module, fqn: str, axis: str) -> ModuleSpec:
        names = expert_weights(module)
        if not names:
            own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
            raise PlanError(f"{fqn}: TensorParallel on experts needs stacked [num_experts, ...] weights and a "
                            f"num_experts attribute; {type(module).__name__} has {own}")
        call = experts_call(module, self.call, fqn)
        layouts = call.tp_layouts(names, fqn)
        rep = {axis: Replicate()}
        return ModuleSpec(params={n: {axis: p} for n, (p, _) in layouts.items()},
                          param_blocks={n: b for n, (_, b) in layouts.items() if b > 1},
                          in_src={i: rep for i in call.token_args}, in_dst={i: rep for i in call.token_args},
                          out_src={"output": {axis: Partial()}}, out_dst={"output": {axis: Partial()}})


def _mro(style: ParallelStyle) -> set[str]:
    return {c.__name__ for c in type(style).__mro__}


def _has(style: ParallelStyle, *hooks: str) -> bool:
    return all(callable(getattr(style, h, None)) for h in hooks)


def _no_parallel(style: ParallelStyle, where: str, placement, both) -> Style:
    src = placement(style.input_layout, where, "input_layout")
    dst = placement(style.desired_input_layout, where, "desired_input_layout")
    out = placement(style.output_layout, where, "output_layout")
    return both(PrepareInput({0: (src, dst)}), PrepareOutput({"output": (Replicate(), out)}))


def behaviour_style(style: ParallelStyle, where: str, *, tp_axis: str, ep_tokens: str, placement, both) -> Style | None:
    """The style here for a torchtitan style recognised by its class's shape, None when ``style``
    is none of them:

    * ``NoParallel`` (``input_layout``, ``desired_input_layout``, ``output_layout`` placements) →
      ``PrepareInputOutput``: argument 0 ``input_layout → desired_input_layout``, the (replicated)
      output onto ``output_layout``; the parameters stay replicated;
    * ``ExpertParallel`` (``_token_dispatch``/``_token_combine``) → ``Experts(tokens=ep_tokens)`` on the
      plan's ``ep_axis``; ``ExpertTensorParallel`` → the same with ``tp_axis=tp_axis, tp_partial=True``;
    * MoE ``TensorParallel`` (``_partition_fn`` and ``_prepare_input_fn``, no token dispatch) → ``ExpertsTP``;
    * the ``_REFUSED`` ones raise naming what to plan instead.

    ``placement(p, where, what)`` checks a placement, ``both(inputs, outputs)`` builds a
    ``PrepareInputOutput``; ``ep_tokens``: ``Experts(tokens=)``."""
    names = _mro(style)
    refused = next((n for n in _REFUSED if n in names), None)
    if refused is not None:
        raise PlanError(f"{where}: torch style {refused}: {_REFUSED[refused]}")
    if all(isinstance(getattr(style, a, None), Placement) for a in ("input_layout", "desired_input_layout",
                                                                      "output_layout")):
        return _no_parallel(style, where, placement, both)
    if _has(style, "_token_dispatch", "_token_combine", "_partition_fn"):
        if "ExpertTensorParallel" in names:
            return Experts(tp_axis=tp_axis, tp_partial=True, tokens=ep_tokens)
        return Experts(tokens=ep_tokens)
    if "TensorParallel" in names and _has(style, "_partition_fn", "_prepare_input_fn"):
        return ExpertsTP()
    return None
