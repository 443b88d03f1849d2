"""How ``hpf.Experts`` calls an experts module: its calling convention (docs/experts.md#calling-conventions).

``Experts`` calls the module's own forward on the rows each rank received (``parallel.experts.styles``), so it
must know how to read the routing from the forward's arguments and how to call the forward back on
rows of its local experts.  Built in: ``"routed"`` (HF's fused experts, ``RoutedCall``) and
``"sorted"`` (torchtitan's ``GroupedExperts``, ``SortedCall``), picked from the forward's positional
arity (three, two) unless ``Experts(call=...)`` names one; any other is an ``ExpertsCall`` subclass.
"""

from __future__ import annotations

__all__ = ["CALLS", "ExpertsCall", "experts_call"]

import copy
import inspect

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Shard

from ...core.errors import PlanError


class ExpertsCall:
    """The calling-convention protocol (see the module docstring); subclass it for your own.  The
    forward must compute each row independently of the others (the rows of one call are split
    across ranks); the output is the token-wise weighted sum of ``run``'s rows."""

    name = "custom"
    #: the forward's positional arguments the boundary carries, and those whose dim 0 is the tokens
    n_args: int = 3
    token_args: tuple[int, ...] = (0, 1, 2)

    def routing(self, args: tuple[Tensor, ...], offset: int, total: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(hidden [T, H], index [T, k] or one-hot [T, k, E], weights [T, k])`` of this rank's
        tokens from the forward's arguments; ``offset``: the position of this rank's first token
        among the ``total`` tokens of the call (0 and T when the rank holds all of them)."""
        raise NotImplementedError

    def run(self, module: nn.Module, rows: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The module's own forward on ``rows [R, H]`` for expert ids ``ids [R, 1]`` (or one-hot
        ``[R, 1, E]``) with unit ``weights [R, 1]``: one output row per row."""
        raise NotImplementedError

    def tp_layouts(self, names: list[str], fqn: str) -> dict[str, tuple[Shard, int]]:
        """Stacked weight name → (its shard over ``tp``, packed blocks along that dim) for TP inside the experts."""
        raise PlanError(f"{fqn}: TP inside experts is not defined for the {self.name!r} calling convention: "
                        "plan Experts(tp_axis=None), or give its ExpertsCall a tp_layouts")

    def bind(self, module: nn.Module) -> ExpertsCall:
        """This convention for ``module`` (what ``experts_call`` returns): itself, unless it reads the
        module (``RoutedCall`` reads its weights' shapes for TP inside)."""
        return self

    def for_call(self, args: tuple) -> ExpertsCall:
        """This convention for one call's arguments: itself, unless their kinds change how the module is
        called back (``SortedCall``: counts given as a list are handed back as a list)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class RoutedCall(ExpertsCall):
    """HF's ``forward(hidden [T, H], top_k_index [T, k] (or a one-hot mask [T, k, E]), top_k_weights [T, k])``
    returning ``[T, H]``, each token's weighted sum over its experts.

    TP inside: each fused weight is split on its dim that is not the hidden size ``H`` (its shape, read
    off the module by ``bind``, says which): ``gate_up_proj`` (HF's ``[E, 2I, H]``, or ``[E, H, 2I]``
    stored for ``x @ w``: Llama 4) in two packed blocks, so each rank holds matching gate and up
    columns, and ``down_proj`` (``[E, H, I]`` or ``[E, I, H]``).  A weight whose two dims both equal
    ``H`` (``I == H``) is split as the module declares its layout (HF's experts: ``is_transposed``),
    and refused by name where it declares none."""

    name = "routed"
    #: the fused weights TP inside splits, by name: packed blocks along the split dim, the side it splits
    TP_WEIGHTS = (("gate_up_proj", 2, "out"), ("down_proj", 1, "in"))
    shapes: dict[str, tuple[int, ...]] | None = None  # set by ``bind``: the module's own parameters' shapes
    hidden: int | None = None  # the hidden size it declares (``hidden_dim``, ``hidden_size``, its config's)
    intermediate: int | None = None  # the intermediate size it declares, when it does
    transposed: bool | None = None  # HF's ``is_transposed``: [E, in, out] weights (``x @ w``); None: undeclared
    concatenated: bool | None = None  # HF's ``is_concatenated``: False for interleaved gate/up columns

    def routing(self, args, offset, total):
        return args[0], args[1], args[2]

    def run(self, module, rows, ids, weights):
        return type(module).forward(module, rows, ids, weights)

    def bind(self, module):
        bound = copy.copy(self)
        bound.shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
        bound.hidden = _declared(module, ("hidden_dim", "hidden_size"))
        bound.intermediate = _declared(module, ("intermediate_dim", "expert_dim", "intermediate_size"))
        flags = [getattr(module, k, None) for k in ("is_transposed", "is_concatenated")]
        bound.transposed, bound.concatenated = (f if isinstance(f, bool) else None for f in flags)
        return bound

    def tp_layouts(self, names, fqn):
        if self.shapes is None:
            raise PlanError(f"{fqn}: the routed convention reads TP inside the experts off the module's weight "
                            "shapes: get it for the module with experts_call(module, call, fqn)")
        roles = {n: self._role(n, fqn) for n in names}
        hidden = self.hidden or self._hidden_from_shapes(names, fqn)
        dims = {n: self._split_dim(n, hidden, fqn) for n in names}
        for n in names:
            declared = None if self.transposed is None else _DECLARED[roles[n][2], self.transposed]
            if dims[n] is not None and declared not in (None, dims[n]):
                raise PlanError(f"{fqn}.{n} {self.shapes[n]}: the module declares is_transposed={self.transposed}, "
                                f"which puts its hidden size on dim {3 - declared}, but that dim is not {hidden}")
            if dims[n] is None:
                dims[n] = declared if declared is not None else self._from_orientation(n, roles, dims, hidden, fqn)
        return {n: (Shard(dims[n]), roles[n][1]) for n in names}

    def _role(self, n: str, fqn: str) -> tuple[str, int, str]:
        role = next((r for r in self.TP_WEIGHTS if n.endswith(r[0])), None)
        if role is None:
            raise PlanError(_not_tp_weight(fqn, n, self.shapes.get(n)))
        if role[1] > 1 and self.concatenated is False:
            raise PlanError(f"{fqn}.{n}: its gate and up columns are interleaved (is_concatenated=False), and TP "
                            "inside the experts splits it as two concatenated halves: plan Experts(tp_axis=None)")
        return role

    def _hidden_from_shapes(self, names, fqn) -> int:
        """The one size every fused weight has among its two non-expert dims (``H``), else a ``PlanError``."""
        common = set.intersection(*(set(self.shapes[n][1:]) for n in names)) if names else set()
        if len(common) != 1:
            raise PlanError(f"{fqn}: TP inside the experts splits each fused weight on its dim that is not the hidden "
                            f"size, which the module does not declare (hidden_dim / hidden_size) and its weights "
                            f"{ {n: self.shapes[n] for n in names} } do not tell (common sizes {sorted(common)}): give "
                            "the module a hidden_dim attribute, or plan Experts(tp_axis=None)")
        return common.pop()

    def _split_dim(self, n: str, hidden: int, fqn: str) -> int | None:
        """The dim of ``n`` that is not ``hidden`` (None: both are, in this view of it)."""
        shape = self.shapes[n]
        if len(shape) != 3:
            raise PlanError(f"{fqn}.{n}: TP inside the experts splits [num_experts, a, b] weights; its shape is {shape}")
        other = [d for d in (1, 2) if shape[d] != hidden]
        if len(other) == 1:
            return other[0]
        if other:
            raise PlanError(f"{fqn}.{n} {shape}: neither of its dims is the experts' hidden size {hidden}, so TP "
                            "inside the experts cannot tell which one to split: plan Experts(tp_axis=None)")
        return None

    def _from_orientation(self, n, roles, dims, hidden, fqn) -> int:
        """``n``'s split dim where both its dims equal ``hidden`` and the module declares no layout.
        Only a local view of a weight whose global shape was not ambiguous (its declared intermediate
        size says so: the skeleton's shard, its intermediate dim divided down to ``H``) takes it from the
        module's other weights (``x @ w.T`` or ``x @ w``, which that global shape decided); a weight
        ambiguous as declared (``I == H``) is refused by name."""
        width = None if self.intermediate is None else self.intermediate * roles[n][1]
        known = [(m, d) for m, d in dims.items() if d is not None]
        if width is None or width == hidden or not known:
            raise PlanError(f"{fqn}.{n} {self.shapes[n]}: both of its dims equal the experts' hidden size {hidden} "
                            "(intermediate size == hidden size), so its shape cannot say which one TP inside the "
                            "experts splits: declare the layout on the module as HF's experts do (is_transposed = "
                            "False for [E, out, in] weights used as F.linear(x, w), True for [E, in, out] used as "
                            "x @ w), or plan Experts(tp_axis=None)")
        m, d = known[0]
        return d if roles[m][2] == roles[n][2] else 3 - d


#: (the side a weight splits, is_transposed) -> its split dim: [E, out, in] weights, or [E, in, out] transposed
_DECLARED = {("out", False): 1, ("in", False): 2, ("out", True): 2, ("in", True): 1}


def _declared(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` the module (else its config) holds as an int."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return int(value)
    return None


def _not_tp_weight(fqn: str, name: str, shape) -> str:
    if name.endswith("_bias"):
        return (f"{fqn}.{name} {shape}: a per-expert bias; TP inside the experts leaves their output a partial sum "
                "over tp, so a bias added inside the experts would be added tp times: plan Experts(tp_axis=None) "
                "for this module")
    return (f"{fqn}: TP inside experts shards gate_up_proj (colwise, packed) and down_proj (rowwise); {name!r} "
            "is neither: plan Experts(tp_axis=None) for this module")


class SortedCall(ExpertsCall):
    """torchtitan's ``forward(x [N, H], num_tokens_per_expert [E])`` on rows grouped by expert in expert
    order, one unweighted output row per row (the MoE block weights and combines them itself); TP inside:
    ``w1``, ``w3`` ``[E, I, H]`` Shard(1), ``w2 [E, H, I]`` Shard(2)."""

    name = "sorted"
    n_args = 2
    token_args = (0,)

    def routing(self, args, offset, total):
        x, counts = args[0], args[1]
        counts = counts if isinstance(counts, Tensor) else torch.as_tensor(counts, device=x.device)
        experts = torch.arange(counts.shape[0], device=counts.device)
        ids = torch.repeat_interleave(experts, counts.long(), output_size=total)[offset:offset + x.shape[0]]
        return x, ids[:, None], x.new_ones((x.shape[0], 1), dtype=torch.float32)

    def run(self, module, rows, ids, weights):
        flat = ids[:, 0]
        order = torch.argsort(flat, stable=True)  # rows arrive by source rank, then expert: group them by expert
        counts = flat.new_zeros(module.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        out = type(module).forward(module, rows[order], counts.tolist() if self.counts_as_list else counts)
        return out[torch.argsort(order)]

    #: whether the module takes its per-expert counts as a list of ints (JetMoE's ``ParallelExperts``
    #: splits its rows by them) rather than a tensor (torchtitan's ``GroupedExperts``)
    counts_as_list = False

    def for_call(self, args: tuple) -> ExpertsCall:
        return _SortedListCall() if isinstance(args[1], (list, tuple)) else self

    def tp_layouts(self, names, fqn):
        roles = {"w1": (Shard(1), 1), "w3": (Shard(1), 1), "w2": (Shard(2), 1)}
        bad = [n for n in names if n not in roles]
        if bad:
            raise PlanError(f"{fqn}: TP inside torchtitan-style experts shards w1, w3 (colwise) and w2 (rowwise); "
                            f"{bad} are none of them: plan Experts(tp_axis=None) for this module")
        return {n: roles[n] for n in names}


#: The built-in conventions by name (``Experts(call="sorted")``).
CALLS: dict[str, ExpertsCall] = {"routed": RoutedCall(), "sorted": SortedCall()}


class _SortedListCall(SortedCall):
    """``SortedCall`` for a module whose counts argument is a list of ints (JetMoE's ``ParallelExperts``)."""

    counts_as_list = True


def experts_call(module: nn.Module, call: str | ExpertsCall | None, fqn: str) -> ExpertsCall:
    """The convention ``call`` names, or (None) the one the module's forward arity says, bound to
    ``module`` (``ExpertsCall.bind``)."""
    if isinstance(call, ExpertsCall):
        return call.bind(module)
    if call is not None:
        if call not in CALLS:
            raise PlanError(f"{fqn}: Experts call={call!r} is not a calling convention (built in: {sorted(CALLS)}, "
                            "or an ExpertsCall instance)")
        return CALLS[call].bind(module)
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return CALLS["routed"].bind(module)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (CALLS["sorted"] if len(positional) == 2 else CALLS["routed"]).bind(module)
