"""``auto_plan``'s head counts: which integer attributes (``self.n_heads``, ``self.split_size``…)
and per-head parameters of a block the skeleton must hold divided, found by replaying the block.

The candidates are the attributes whose traced ints fed a shape call inside the block and its
1-D parameters as long as a head count.  Every subset, smallest first (among equals, those whose
names say "heads" or "split" first), is tried by running the block alone on a meta copy at the
local shapes its styles give, with its own traced arguments, and comparing it op by op with the
global run (``analysis.audit``: the shape audit the compiler also runs).  A subset fits when
every op's local result is its global result divided along the dim the plan says — a ``-1`` that
lands the division on the sequence, or a head cut in two, does not fit.  The first that fits
wins; None when none does.
"""

from __future__ import annotations

__all__ = ["inside", "join", "says_heads", "search_heads", "shared_head_tables", "split_tail", "splits_last"]

import itertools
import math
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Shard

from ..analysis.arguments import per_head_arguments
from ..analysis.audit import compare, handoff, record
from ..analysis.trace import RESHAPES, ModelTrace, ShapeCall
from ..core.style import Style
from ..parallel.tensor.channels import Channels

MAX_CANDIDATES = 6  # at most 2**6 replays per distinct block


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def inside(path: str, block: str) -> bool:
    return path != block and (not block or path.startswith(block + "."))


def split_tail(c: ShapeCall) -> tuple[int, ...] | None:
    """The dims a shape call splits its input's last dim into (None: it does not), its leading
    dims kept or merged (ViTDet's ``(B, H, W, 3C)`` → ``(B, H*W, 3, heads, D)``)."""
    if c.op not in RESHAPES or not c.shapes_out or not c.shape_in:
        return None
    out, k = c.shapes_out[0], len(c.shape_in) - 1
    if len(out) > k + 1 and out[:k] == c.shape_in[:k]:
        return tuple(out[k:])
    lead = 1
    for i in range(len(out) - 1):
        if lead == math.prod(c.shape_in[:k]) and math.prod(out[i:]) == c.shape_in[k] and len(out) - i >= 2 \
                and out[i] != c.shape_in[k]:
            return tuple(out[i:])
        lead *= out[i]
    return None


def splits_last(c: ShapeCall) -> bool:
    """Whether a shape call splits its input's last dim into several (``split_tail``)."""
    return split_tail(c) is not None


def relative(path: str, block: str) -> str:
    """``path`` below ``block`` (``block`` itself: "")."""
    return path[len(block) + 1:] if block and path != block else ("" if path == block else path)


def _local(model_block: nn.Module, block: str, styles: Mapping[str, Style], axis: str, n: int):
    """(local parameter shapes, attributes as the styles leave them, the opaque children with
    the layout their outputs are handed on in) below ``block``."""
    shapes, attrs, opaque = {}, {}, {}
    for path, style in styles.items():
        rel = relative(path, block)
        sub = model_block.get_submodule(rel)
        spec = style.spec(sub, path, axis)
        if rel and any(isinstance(pl.get(axis), Shard) for pl in spec.params.values()):
            opaque[rel] = handoff(spec, axis, n)
        for name, per_axis in spec.params.items():
            pl, full = per_axis.get(axis), getattr(sub, name)
            if isinstance(pl, Shard):
                shape = list(full.shape)
                shape[pl.dim % len(shape)] //= n
                shapes[join(rel, name)] = tuple(shape)
        if isinstance(style, Channels):  # a BatchNorm reads its channels' slice of its whole running statistics
            shapes.update({join(rel, b): (t.shape[0] // n,) for b, t in sub.named_buffers(recurse=False)
                           if t.dim() == 1 and t.shape[0] == getattr(sub, "num_features", None)})
        for attr in spec.divide_attrs:
            attrs[join(rel, attr)] = getattr(sub, attr) // n
    return shapes, attrs, opaque


def search_heads(trace: ModelTrace, block: str, module: nn.Module, styles: Mapping[str, Style], axis: str, n: int,
                 attrs: list[tuple[str, str]], per_head: list[str], heads: frozenset[int] = frozenset()
                 ) -> tuple[tuple, tuple] | None:
    """The smallest (attributes, per-head parameters) to divide with which the block replays at
    local shapes as it does globally (see the module docstring); None: no subset does.  Where
    none does, the search is tried once more with the block's other tensor arguments of one
    value per head (T5's position bias, handed on from the first layer) at local shapes."""
    call = trace.calls.get(block)
    if call is None:
        return None
    shapes, fixed, opaque = _local(module, block, styles, axis, n)
    outputs: dict = {}
    ref, ok = record(module, call.args, call.kwargs, opaque=dict.fromkeys(opaque), outputs=outputs)
    if not ok:
        return None
    cands = ([("attr", a) for a in attrs] + [("param", p) for p in per_head])[:MAX_CANDIDATES]
    subsets = sorted((c for k in range(len(cands) + 1) for c in itertools.combinations(cands, k)),
                     key=lambda c: (len(c), -sum(says_heads(x) for x in c)))
    arguments = [(call.args, call.kwargs)]
    per_head_args = per_head_arguments(call.args, call.kwargs, heads, n)
    if per_head_args is not None:
        arguments.append(per_head_args)
    for args, kwargs in arguments:
        found = _first_fit(module, block, subsets, args, kwargs, shapes, fixed, opaque, outputs, ref, n)
        if found is not None:
            return found
    return None


def _first_fit(module, block, subsets, args, kwargs, shapes, fixed, opaque, outputs, ref, n):
    """The first subset with which the block replays at local shapes as it does globally."""
    for subset in subsets:
        values, local = dict(fixed), dict(shapes)
        for kind, x in subset:
            if kind == "attr":
                owner, name = x
                rel = relative(owner, block)
                value = getattr(module.get_submodule(rel) if rel else module, name)
                values[join(rel, name)] = value // n
            else:
                rel = relative(x, block)
                shape = list(module.get_parameter(rel).shape)
                shape[-1 if len(shape) > 1 else 0] //= n  # a table of one column per head: its columns
                local[rel] = tuple(shape)
        ops, ok = record(module, args, kwargs, shapes=local, attrs=values, opaque=opaque,
                         outputs={k: list(v) for k, v in outputs.items()})
        if ok and compare(ref, ops, n) is None:
            return (tuple(x for kind, x in subset if kind == "attr"), tuple(x for kind, x in subset if kind == "param"))
    return None


def says_heads(candidate) -> bool:
    kind, x = candidate
    name = (x[1] if kind == "attr" else x.rpartition(".")[2]).lower()
    return ("head" in name and "dim" not in name) or "split" in name


def shared_head_tables(trace: ModelTrace, modules: Mapping[str, nn.Module], heads: Mapping[str, frozenset[int]],
                       blocks: Mapping[str, object], n: int) -> list[str]:
    """Tables outside every block whose output of one column per head the head-split blocks (``heads``:
    block → its head counts) take as an argument besides their hidden states (MPNet's relative position
    bias, computed once by the encoder and handed to every layer; CPM-Ant's segment position bias): on a
    rank the block adds it to its own heads' scores, so the table is split by its columns too.  Only a
    module whose own parameters are all tables as wide as a head count that divides the axis, with no
    parameters below it, whose every consumer is such a block or encloses one."""
    def serves(c: str) -> bool:
        return any(c == p or inside(c, p) or inside(p, c) for p in heads)

    counts = frozenset().union(*heads.values())
    out = []
    handed = {q for p in heads if p in trace.calls for q in trace.calls[p].producers - trace.calls[p].first}
    for path in sorted(handed):
        m = modules.get(path)
        own = list(m.named_parameters(recurse=False)) if m is not None else []
        if (own and len(own) == sum(1 for _ in m.parameters())
                and all(q.dim() == 2 and q.shape[-1] in counts and q.shape[-1] % n == 0 for _, q in own)
                and not any(path == b or inside(path, b) for b in blocks)
                and all(serves(c) for c in trace.consumers.get(path, ()))):
            out += [join(path, name) for name, _ in own]
    return out
