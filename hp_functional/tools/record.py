"""Recording one step's collectives for ``explain``: which planned module runs (forward) or
created the autograd node that runs (backward), and every ``_c10d_functional`` collective."""

from __future__ import annotations

__all__ = ["CollectiveRecorder", "ModuleClock", "ModuleHooks", "ScheduleRow"]

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


@dataclass(frozen=True)
class ScheduleRow:
    """One collective of the schedule: who issues it, in which pass, on which axis, how big.

    ``bytes`` is the size of the unsharded buffer it moves (NCCL-tests' "size"): an all-reduce's tensor,
    an all-gather's output, a reduce-scatter's input, an all-to-all's input.  On a ring each rank sends
    (n-1)/n of it for all-gather/reduce-scatter, 2(n-1)/n for an all-reduce."""

    module: str  # planned module FQN, "(loss)", "(parameters)" or "(unplanned)"
    direction: str  # "fwd" or "bwd"
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, ppermute (point-to-point: one peer each way)
    axis: str
    bytes: int  # size of the unsharded buffer (see the class docstring)
    dtype: str


class ModuleHooks:
    """Global forward hooks on every module while the context is active (``_pre``/``_post``, as
    ``register_module_forward_pre_hook``/``register_module_forward_hook`` call them)."""

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


class ModuleClock(ModuleHooks):
    """Global module hooks: which planned module runs (forward) and which autograd sequence
    numbers each planned module's forward allocated (to attribute backward nodes)."""

    def __init__(self, planned: set[str]):
        self.planned = planned
        self.names: dict[int, str] | None = None  # id(skeleton module) → FQN, from the first (root) call
        self.stack: list[tuple[str, int]] = []  # (fqn, first sequence nr) of running planned modules
        self.spans: list[tuple[int, int, str]] = []
        self.root_span: tuple[int, int] | None = None
        self.depth = 0

    def _pre(self, module, args) -> None:
        if self.names is None:
            self.names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
            self.root_start = torch._C._autograd._get_sequence_nr()
        self.depth += 1
        fqn = self.names.get(id(module))
        if fqn in self.planned:
            self.stack.append((fqn, torch._C._autograd._get_sequence_nr()))

    def _post(self, module, args, output) -> None:
        self.depth -= 1
        now = torch._C._autograd._get_sequence_nr()
        if self.stack and self.names is not None and self.stack[-1][0] == self.names.get(id(module)):
            fqn, start = self.stack.pop()
            self.spans.append((start, now, fqn))
        if self.depth == 0 and self.root_span is None:
            self.root_span = (self.root_start, now)

    def forward_owner(self) -> str:
        if self.stack:
            return self.stack[-1][0]
        return "(parameters)" if self.names is None else "(loss)" if self.root_span else "(unplanned)"

    def backward_owner(self, seq: int) -> str:
        inside = [(end - start, fqn) for start, end, fqn in self.spans if start <= seq < end]
        if inside:
            return min(inside)[1]
        if self.root_span and seq >= self.root_span[1]:
            return "(loss)"
        return "(parameters)" if self.root_span is None or seq < self.root_span[0] else "(unplanned)"


class CollectiveRecorder(TorchDispatchMode):
    """Records every ``_c10d_functional`` collective with its owner, pass, axis and size."""

    def __init__(self, clock: ModuleClock, axes: dict[str, str], params: list[tuple[str, str]], first_seq: int):
        super().__init__()
        self.clock, self.axes, self.params, self.first_seq = clock, axes, params, first_seq
        self.rows: list[ScheduleRow] = []

    def _owner(self, op: str) -> tuple[str, str]:
        if torch._C._current_graph_task_id() == -1:
            return self.clock.forward_owner(), "fwd"
        node = torch._C._current_autograd_node()
        seq = node._sequence_nr() if node is not None else -1
        owner = self.clock.backward_owner(seq)
        index = seq - self.first_seq
        if owner == "(parameters)" and 0 <= index < len(self.params) and self.params[index][1].startswith(op):
            owner = self.params[index][0]  # the module owning the converted parameter
        return owner, "bwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name != "wait_tensor":
            x, op = args[0], _OPS.get(name, name)
            if op == "all_to_all" and _one_peer(args[1]) and _one_peer(args[2]):
                op = "ppermute"  # core.collectives.raw_ppermute: a send and a receive (ring attention's steps)
            size = x.numel() * x.element_size() * (args[1] if op == "all_gather" else 1)
            module, direction = self._owner(op)
            self.rows.append(ScheduleRow(module, direction, op, self.axes.get(str(args[-1]), str(args[-1])), size,
                                        str(x.dtype).removeprefix("torch.")))
        return func(*args, **(kwargs or {}))


def _one_peer(splits) -> bool:
    """Whether an ``all_to_all_single`` split list names at most one peer (a point-to-point step)."""
    return splits is not None and sum(1 for n in splits if n) <= 1
