"""``auto_plan``'s blocks: the projections of one module paired colwise → rowwise from a traced
forward, their packing, and the head counts the skeleton must hold divided (searched with the
shape audit: ``planner.heads``, ``analysis.audit``).  The rules and how ambiguity is resolved:
docs/auto-plan.md#pairing-and-how-ambiguity-is-resolved and
docs/auto-plan.md#head-counts-found-by-the-shape-audit.
"""

from __future__ import annotations

import inspect

__all__ = ["Block", "heads_of", "is_channel_conv", "is_norm", "is_projection", "out_features", "pair", "plan_block",
           "split_width"]

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.distributed.tensor import Replicate

from ..analysis.trace import INPUT, ModelTrace, ModuleCall
from ..core.style import Style
from ..parallel.tensor.channels import CONVS, Channels
from ..parallel.tensor.styles import Colwise, Heads, NoParallel, Rowwise, is_conv1d
from .heads import inside, join, says_heads, search_heads, split_tail, splits_last

COL_NAMES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "c_fc", "wq", "wk", "wv", "query",
             "key", "value", "q", "k", "v", "fc1", "fc_in", "dense_h_to_4h", "q_lin", "k_lin", "v_lin", "lin1",
             "qkv_proj", "qkv", "c_attn", "Wqkv", "query_key_value", "in_proj", "gate_up_proj", "w13", "w12"}
ROW_NAMES = {"o_proj", "out_proj", "down_proj", "w2", "c_proj", "wo", "o", "dense", "fc2", "fc_out",
             "dense_4h_to_h", "out_lin", "lin2", "proj"}
KV_NAMES = {"k_proj", "v_proj", "wk", "wv", "key", "value", "k", "v", "k_lin", "v_lin"}


_NO_CALL = ModuleCall()


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear`` (or a subclass whose forward takes its input alone: Falcon's ``input @
    weight.T + bias``), or HF's ``Conv1D``.  A subclass whose forward takes more may read its
    weight otherwise (Ovis2.5's visual table: ``forward(x, *, lookup)`` looks rows up across the
    whole table with ``F.embedding(ids, self.weight.T)``), so no split of it can be assumed."""
    if is_conv1d(module):
        return True
    if not isinstance(module, nn.Linear):
        return False
    forward = type(module).forward
    if forward is nn.Linear.forward:
        return True
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def is_channel_conv(module: nn.Module) -> bool:
    """A convolution ``Colwise``/``Rowwise`` split by channels (groups 1)."""
    return isinstance(module, CONVS) and module.groups == 1


def is_per_channel(module: nn.Module) -> bool:
    """A module ``Channels`` splits between a channel-split pair: a grouped (depthwise)
    convolution whose groups divide with its channels, an ``nn.BatchNorm1d/2d/3d`` of torch's own
    forward, an ``nn.GroupNorm``."""
    if isinstance(module, CONVS):
        return module.groups > 1
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return type(module).forward is nn.modules.batchnorm._BatchNorm.forward
    return isinstance(module, nn.GroupNorm)


def is_norm(module: nn.Module) -> bool:
    """A norm-like module: only 1-D parameters of its own, and "norm" in its class name."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() == 1 for p in own) and "norm" in type(module).__name__.lower()


def out_features(module: nn.Module) -> int:
    return module.nf if is_conv1d(module) else module.out_channels if isinstance(module, CONVS) else module.out_features


def split_width(module: nn.Module, role: str) -> int:
    """The features a ``role`` ("colwise"/"rowwise") splits: the output's of a colwise projection,
    the input's of a rowwise one."""
    if role == "colwise":
        return out_features(module)
    return module.weight.shape[0] if is_conv1d(module) else module.in_channels if isinstance(module, CONVS) \
        else module.in_features


@dataclass
class Block:
    """What ``plan_block`` decided for one block: ``styles`` per module path (projections, per-head
    norms, ``Heads`` on the modules whose head counts are divided), ``roles`` per module path (for
    the coverage report), ``heads`` (owner path → attributes divided), ``per_head`` parameter FQNs
    sharded by head, ``gathered`` (no head subset localises the block: its colwise outputs are
    all-gathered and its rowwise inputs split locally, HF's ``colwise_gather_output`` /
    ``rowwise_split_input``), and what to report: ``uncovered`` modules, ``notes`` and ``errors``."""

    path: str
    styles: dict[str, Style] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    per_head: tuple[str, ...] = ()
    param_roles: dict[str, str] = field(default_factory=dict)
    gathered: bool = False
    attention: bool = False  # its colwise outputs are viewed into heads (or it holds head counts)
    uncovered: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _holds(path: str, projections: set[str]) -> bool:
    """Whether a projection of ``projections`` lies below module ``path``."""
    return any(inside(p, path) for p in projections)


def _residual(trace: ModelTrace, path: str, module: nn.Module, block: str) -> bool:
    """Whether ``path`` is a norm that also takes something from outside ``block`` (the residual
    stream): a colwise/rowwise pair never spans one (a per-head norm takes only its projection)."""
    return is_norm(module) and any(p == INPUT or not inside(p, block) for p in trace.producers(path))


def _modulates(trace: ModelTrace, parent: str, node: str, projections: set[str]) -> bool:
    """Whether ``parent``'s output mixes ``node``'s with its own input stream passed through a
    module of its own (an adaLN's ``norm(x) * (1 + scale) + shift``): then ``node`` modulates the
    stream rather than computing features a projection contracts, and the flow stops there."""
    call = trace.calls[parent]
    return any(m != node and m not in projections and inside(m, parent) and trace.producers(m) & call.first
               for m in call.main)


def _called_twice(trace: ModelTrace, path: str) -> bool:
    """Whether ``path`` ran more often than the nearest called module enclosing it: twice in one
    call of its parent (SwinV2's ``drop_path`` after attention and after the MLP), its calls' flows
    are one node in the trace and following it would join unrelated uses.  As often as its parent
    (ALBERT's one layer run at every depth), each call is the same flow."""
    parent = path
    while parent:
        parent = parent.rpartition(".")[0]
        if parent in trace.calls:
            return trace.calls[path].count > trace.calls[parent].count
    return trace.calls[path].count > 1


def _reached(trace: ModelTrace, start: str, block: str, candidates: set[str], projections: set[str],
             modules: Mapping[str, nn.Module]) -> tuple[set[str], set[str]]:
    """(``candidates`` that ``start``'s output reaches inside ``block``, modules passed on the way).

    Data flows to the modules that consume it and out of the module it was computed in (its
    output is the enclosing module's output: BERT's ``attention.self`` hands the heads to
    ``attention.output.dense``).  It stops at any other projection, at a module that holds one,
    at a norm on the residual stream, and at a module called more often than its parent
    (``_called_twice``)."""
    seen, hit, passed, todo = set(), set(), set(), [start]
    while todo:
        node = todo.pop()
        for c in trace.consumers.get(node, ()):
            if c in seen or not inside(c, block):
                continue
            seen.add(c)
            if c in candidates:
                hit.add(c)
            elif not (c in projections or _holds(c, projections) or _residual(trace, c, modules[c], block)
                      or _called_twice(trace, c)):
                passed.add(c)
                todo.append(c)
        parent = node.rpartition(".")[0]
        if (node and inside(parent, block) and parent not in seen and node in trace.calls.get(parent, _NO_CALL).main
                and not _modulates(trace, parent, node, projections)):
            seen.add(parent)  # left through the enclosing module's output: not passed through it
            todo.append(parent)
    return hit, passed


def packing(trace: ModelTrace, proj: str, width: int) -> int | tuple[int, ...] | None:
    """The pieces the block cuts ``proj``'s output into along its last dim (None: not packed)."""
    mine = [c for c in trace.shape_calls if c.sources == {proj} and c.shape_in and c.shape_in[-1] == width]
    for c in mine:
        if c.op in ("split", "chunk") and len(c.shapes_out) > 1 and all(s[:-1] == c.shape_in[:-1] for s in c.shapes_out):
            sizes = tuple(s[-1] for s in c.shapes_out)
            return len(sizes) if len(set(sizes)) == 1 else sizes
        if (tail := split_tail(c)) is not None:
            return tail[0] if len(tail) >= 3 and tail[0] in (2, 3) else None
    pieces = [c.shapes_out[0][-1] for c in mine if c.op == "getitem" and c.shapes_out
              and c.shapes_out[0][:-1] == c.shape_in[:-1] and c.shapes_out[0][-1] < width]
    if len(pieces) > 1 and sum(pieces) == width:
        return len(pieces) if len(set(pieces)) == 1 else tuple(pieces)
    return None


def heads_of(trace: ModelTrace, proj: str) -> set[int]:
    """Head counts of ``proj``'s output: the views that split a last dim of it into (..., H, D)."""
    return {c.shape_in[-1] // c.shapes_out[0][-1] for c in trace.shape_calls
            if c.sources == {proj} and splits_last(c) and 0 < c.shapes_out[0][-1] <= c.shape_in[-1]}


def pair(trace: ModelTrace, block: str, modules: Mapping[str, nn.Module], candidates: list[str],
         projections: set[str]) -> tuple[dict[str, str], set[str], list[str]]:
    """(projection → "colwise"/"rowwise", the modules between them, the unpaired ones) for the
    ``candidates`` inside ``block``; every other projection of ``projections`` stops the flow."""
    cands = set(candidates)
    reach = {p: _reached(trace, p, block, cands, projections, modules) for p in candidates}
    fed = {q for hit, _ in reach.values() for q in hit}
    roles, unpaired, chained = {}, [], []
    for p in candidates:
        name = p.rpartition(".")[2]
        col, row = bool(reach[p][0]) and not _mixed_whole(trace, p, modules[p]), p in fed
        said = "colwise" if name in COL_NAMES else "rowwise" if name in ROW_NAMES else None
        if col and row and said is None and isinstance(modules[p], CONVS):
            chained.append(p)  # a chain of convolutions: alternated below, in call order
        elif col and row and said is None:  # neither end of a pair by its flow alone: left unpaired (replicated)
            unpaired.append(p)
        elif col and row:
            roles[p] = said
        elif col or row:
            roles[p] = "colwise" if col else "rowwise"  # the dataflow decides; a name only breaks a tie
        else:
            unpaired.append(p)
    for p in sorted(chained, key=list(trace.calls).index):  # VGG's conv → conv → conv → conv: col, row, col, row
        roles[p] = "rowwise" if any(roles.get(q) == "colwise" and p in reach[q][0] for q in candidates) else "colwise"
    while lone := [p for p, r in roles.items() if not _partners(p, r, roles, reach)]:  # a chain of three's last
        for p in lone:
            del roles[p]
        unpaired += lone
    between = {m for p, r in roles.items() if r == "colwise" for m in reach[p][1]}
    return roles, between, unpaired


def _mixed_whole(trace: ModelTrace, proj: str, module: nn.Module) -> bool:
    """Whether an op combines the whole width of ``proj``'s output (``ModelTrace.mixes``: a softmax,
    norm or sum over its last dim, before any view splits it into heads): then no rank may hold a
    part of it, and ``proj`` cannot be colwise (Granite Speech's ``softmax(out(h))`` fed to ``out_mid``)."""
    if not isinstance(module, nn.Linear) and not is_conv1d(module):
        return False
    call = trace.calls.get(proj)
    first = next((a for a in (call.args if call else ()) if isinstance(a, Tensor)), None)
    rank = first.dim() if first is not None else None
    width = out_features(module)
    return any(proj in c.sources and c.shape_in and c.shape_in[-1] == width and len(c.shape_in) == rank
               for c in trace.mixes)


def _partners(p: str, role: str, roles: Mapping[str, str], reach) -> list[str]:
    """The rowwise projections a colwise ``p`` feeds, or the colwise ones feeding a rowwise ``p``
    (VideoMT's fc1 → fc2 → fc3: fc2 rowwise by name, so fc3 is fed by no colwise and pairs with none)."""
    if role == "colwise":
        return [q for q in reach[p][0] if roles.get(q) == "rowwise"]
    return [q for q, r in roles.items() if r == "colwise" and p in reach[q][0]]


def check_heads(trace: ModelTrace, cols: list[str], n: int, axis: str) -> list[str]:
    """Messages for colwise projections whose heads do not divide the axis (KV ones that have
    fewer heads than ranks are the KV-head pass's)."""
    bad = []
    for p in cols:
        for h in sorted(heads_of(trace, p)):
            kv = p.rpartition(".")[2] in KV_NAMES and n % h == 0
            if h % n and not kv:
                bad.append(f"{p}: {h} heads do not split over {n} ranks of axis {axis!r}")
    return bad


def plan_block(trace: ModelTrace, model: nn.Module, block: str, roles: Mapping[str, str], between: set[str], n: int,
               axis: str, cache: dict) -> Block:
    """Rule 4 of ``auto_plan`` for the projections paired in ``block`` (``pair``: their ``roles``
    and the modules ``between`` them); ``cache`` holds the head search of identical layers, so it
    runs once per kind.  KV projections with fewer heads than ranks (the axis size a multiple of
    them) stay plain ``Colwise``, their head-count attributes divided by name, for the compiler's
    KV-head pass."""
    modules, out = dict(model.named_modules(remove_duplicate=False)), Block(block)
    cols = [p for p, r in roles.items() if r == "colwise"]
    styles = _projection_styles(trace, modules, roles, out)
    norms = _between_styles(modules, between, cols, out)
    attrs = sorted({a for c in trace.shape_calls if c.module == block or inside(c.module, block)
                    for a in c.attrs if (a[0] == block or inside(a[0], block)) and a[0] not in roles})
    out.errors = check_heads(trace, cols, n, axis) + _undivided(modules, attrs, n, axis)
    out.attention = any(heads_of(trace, p) for p in cols) or any(says_heads(("attr", a)) for a in attrs)
    if out.errors:
        return out
    heads = {h for p in cols for h in heads_of(trace, p)} | {getattr(modules[o], a) for o, a in attrs}
    per_head = _per_head_params(modules, block, heads, roles, out)
    few_kv = [p for p in cols if any(h < n for h in heads_of(trace, p))]  # check_heads: n % h == 0 for these
    if few_kv:  # the compiler's KV-head pass replicates them; a replay here cannot model that layout
        found = (tuple(a for a in attrs if says_heads(("attr", a)) and "split" not in a[1]),
                 tuple(q for q in per_head if (t := model.get_parameter(q)).shape[per_head_dim(t)] == max(heads)))
        out.notes.append(f"{block}: {few_kv} have fewer heads than the {n} ranks; left plain Colwise for the "
                         "compiler's KV-head replication")
    else:
        found = _cached_search(trace, model, block, {**styles, **norms}, attrs, per_head, n, axis, cache, heads)
    if found is None and any(isinstance(modules[p], CONVS) for p in roles):  # gathering whole feature maps: no
        styles, norms, found = {p: NoParallel() for p in roles}, {}, ((), ())
        out.roles.update(dict.fromkeys(roles, "replicated: its channel pair does not replay at local shapes"))
        out.notes.append(f"{block}: its convolutions do not replay at local channel counts; left replicated")
    elif found is None:
        styles, norms, found, out.gathered = _gathered(roles), {}, ((), ()), True
        out.roles.update({p: f"{r} (gathered: heads not localisable)" for p, r in roles.items()})
        out.notes.append(f"{block}: its heads could not be localised (no head count to divide replays it at local "
                         "shapes); colwise outputs gathered, rowwise inputs split")
    _settle(out, styles, norms, found)
    return out


def _projection_styles(trace: ModelTrace, modules: Mapping[str, nn.Module], roles: Mapping[str, str],
                       out: Block) -> dict[str, Style]:
    """``Colwise`` (packed where the trace shows a packed projection) or ``Rowwise`` per paired projection; their
    roles recorded in ``out``."""
    styles: dict[str, Style] = {}
    for p, r in roles.items():
        packed = packing(trace, p, out_features(modules[p])) if r == "colwise" else None
        styles[p] = Colwise(packed=packed) if packed else Colwise() if r == "colwise" else Rowwise()
        out.roles[p] = f"{r} (packed {packed})" if packed else r
    return styles


def _between_styles(modules: Mapping[str, nn.Module], between: set[str], cols: list[str], out: Block) -> dict[str, Style]:
    """The styles of the modules ``between`` the projections: ``Channels`` for each per-channel module between
    convolutions, else ``NoParallel(reduce_grads=True)`` for each norm (per head); any other module there that
    holds parameters is recorded in ``out`` as uncovered."""
    if any(isinstance(modules[p], CONVS) for p in cols):  # channels: each module between computes per channel
        norms: dict[str, Style] = {m: Channels() for m in sorted(between) if is_per_channel(modules[m])}
    else:
        norms = {m: NoParallel(reduce_grads=True) for m in sorted(between) if is_norm(modules[m])}
    for m in sorted(between - set(norms)):
        if any(True for _ in modules[m].parameters(recurse=False)):
            out.uncovered.append(f"{m} ({type(modules[m]).__name__}: between colwise and rowwise projections)")
            out.roles[m] = "uncovered (between colwise and rowwise projections)"
    return norms


def _per_head_params(modules: Mapping[str, nn.Module], block: str, heads: set[int], roles: Mapping[str, str],
                     out: Block) -> list[str]:
    """The block's candidate per-head parameters: its own vectors of a head count's length and the head tables
    below it; its other own parameters are recorded in ``out`` as replicated (used outside the sharded region, a
    layer scale on the output: else the audit refuses)."""
    owned = list(modules[block].named_parameters(recurse=False))
    per_head = [join(block, name) for name, q in owned if q.dim() == 1 and q.shape[0] in heads]
    per_head += _head_tables(modules, block, heads, roles)
    for name, _ in owned:
        if join(block, name) not in per_head:
            out.param_roles[join(block, name)] = "parameter of the block (replicated: outside its sharded region)"
    return per_head


def _settle(out: Block, styles: Mapping[str, Style], norms: Mapping[str, Style], found: tuple) -> None:
    """Record the decided styles in ``out``: the projections' and the norms', ``Heads`` on each owner of the head
    counts the search divided (``found[0]``) and the per-head parameters it shards (``found[1]``)."""
    out.roles.update({m: "per-channel (channels split)" if isinstance(st, Channels) else
                      "per-head norm (replicated, grads all-reduced)" for m, st in norms.items()})
    out.styles.update({**styles, **norms})
    for owner, attr in found[0]:
        out.heads[owner] = (*out.heads.get(owner, ()), attr)
    for owner, names in out.heads.items():
        out.styles[owner], out.roles[owner] = Heads(attrs=names), "attention (head counts divided)"
    out.per_head = tuple(found[1])


def _head_tables(modules: Mapping[str, nn.Module], block: str, heads: set[int], roles: Mapping[str, str]) -> list[str]:
    """Tables of one column per head below ``block`` (T5's relative position bias, an
    ``nn.Embedding``; Swin's and BEiT's ``relative_position_bias_table``), as per-head candidates."""
    return [join(p, name) for p, m in modules.items() if (p == block or inside(p, block)) and p not in roles
            for name, q in m.named_parameters(recurse=False) if q.dim() == 2 and q.shape[-1] in heads]


def per_head_dim(param) -> int:
    """The dim a per-head parameter is sharded on: a vector's only dim, a table's columns."""
    return 0 if param.dim() == 1 else param.dim() - 1


def _undivided(modules: Mapping[str, nn.Module], attrs, n: int, axis: str) -> list[str]:
    """Head-count attributes (by name) that do not divide the axis (KV counts that the axis size
    is a multiple of are the KV-head pass's)."""
    bad = []
    for owner, attr in attrs:
        value = getattr(modules[owner], attr)
        kv = "kv" in attr or "key_value" in attr
        if says_heads(("attr", (owner, attr))) and "split" not in attr and value % n and not (kv and n % value == 0):
            bad.append(f"{owner}: {attr}={value} does not divide over {n} ranks of axis {axis!r}")
    return bad


def _cached_search(trace, model, block, styles, attrs, per_head, n, axis, cache, heads):
    """``search_heads`` once per kind of block: identical layers reuse the first one's result."""
    m = model.get_submodule(block) if block else model
    cut = len(block)
    key = (type(m), tuple((k, tuple(v.shape)) for k, v in m.named_parameters()),
           tuple((o[cut:], a, getattr(model.get_submodule(o) if o else model, a)) for o, a in attrs),
           tuple((k[cut:], s) for k, s in styles.items()), tuple(p[cut:] for p in per_head),
           _argument_shapes(trace.calls[block]) if block in trace.calls else None)
    if key not in cache:
        cache[key] = (block, search_heads(trace, block, m, styles, axis, n, attrs, per_head, frozenset(heads)))
    first, found = cache[key]
    if found is None or first == block:
        return found
    move = lambda x: block + x[len(first):]  # noqa: E731 - the first layer's result at this block's paths
    return tuple((move(o), a) for o, a in found[0]), tuple(move(p) for p in found[1])


def _argument_shapes(call) -> tuple:
    """The call's arguments as (name, shape) pairs: layers called alike share a head search."""
    return (tuple(tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__ for a in call.args),
            tuple((k, tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__) for k, v in call.kwargs.items()))


def _gathered(roles: Mapping[str, str]) -> dict[str, Style]:
    """The block's projections with colwise outputs gathered and rowwise inputs split locally."""
    return {p: Colwise(gather_output=True) if r == "colwise" else Rowwise(input_layout=Replicate())
            for p, r in roles.items()}
