"""``auto_plan(model, mesh)``: a tensor-parallel plan for a model that declares none, read off
the model's module types, its structure and one forward traced on a meta copy (``analysis.trace``).

Every module takes the role of the first rule that matches; the rules numbered in the comments
below (1-8: MoE, embeddings, head, projections, norms, biases, the rest, storage split) are the table of
docs/auto-plan.md#roles.  Nothing here communicates: every error is raised on every rank alike,
before any collective.
"""

from __future__ import annotations

__all__ = ["auto_plan"]

from collections import Counter
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..analysis.towers import trace_towers
from ..analysis.trace import INPUT, ModelTrace, example_call, trace_model
from ..core.errors import PlanError
from ..core.paths import path_matches
from ..core.style import Style
from ..parallel.experts.styles import Experts, expert_members, expert_weights, is_experts, not_per_expert
from ..parallel.tensor.styles import Colwise, NoParallel, ShardedParams
from ..parallel.tensor.vocab import VocabEmbedding
from ..plan.plan import ShardingPlan
from . import blocks as B
from .heads import inside, join, shared_head_tables
from .report import AutoPlan, collapse, coverage, merge_overrides
from .sp import sequence_parallel as sequence_parallel_plan


def _ancestors(path: str) -> list[str]:
    """``path``'s enclosing modules, innermost first, the root ("") last."""
    out = []
    while path:
        path = path.rpartition(".")[0]
        out.append(path)
    return out


def auto_plan(model: nn.Module, mesh: DeviceMesh, *, tp_axis: str = "tp", sequence_parallel: bool = False,
              loss_parallel: bool = False, overrides: Mapping[str, object] | None = None,
              allow_uncovered: bool = False, example_inputs=None, base: ShardingPlan | None = None,
              split_convolutions: bool = False) -> AutoPlan:
    """A ``ShardingPlan`` for ``model`` on ``mesh``'s ``tp_axis`` (docs/auto-plan.md).

    Args:
        model: the model to plan; only read (a meta model works).
        mesh: the device mesh; only the size of ``tp_axis`` is used.
        tp_axis: the mesh axis to shard over.
        sequence_parallel: also shard the residual stream's sequence between the blocks (Megatron-SP, ``planner.sp``).
        loss_parallel: keep the head's logits vocab-sharded and compute HF's causal-LM loss on them (needs
            ``get_output_embeddings()``).
        overrides: ``{path or pattern: style or None}`` merged into the generated plan (a style wins, ``None``
            clears, a key that matches no module is a ``PlanError``).
        allow_uncovered: leave MoE blocks, unpaired projections and parameters no rule covers replicated
            instead of raising ``PlanError``.
        example_inputs: what one forward takes (a tensor, a tuple of arguments or a dict of keyword arguments;
            shapes and dtypes only, moved to meta); None: ``input_ids`` of shape (1, 8) when the model starts
            with an embedding.
        base: a plan whose entries, special handlers and settings are kept as they are (``ShardingPlan.from_hf``
            of a vision-language model, which plans its text model only); auto_plan plans the modules none of
            its entries reaches (the vision tower, the projector).
        split_convolutions: pair convolutions (groups 1) by dataflow as projections are paired, their channels
            split (``Colwise``/``Rowwise`` on them, ``Channels`` on the BatchNorm, GroupNorm or depthwise
            convolution between); off: every convolution replicated, as the coverage table says.
    Returns:
        an ``AutoPlan``: the plan, with ``coverage`` / ``explain()`` listing every parameter's role."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if tp_axis not in names:
        raise PlanError(f"auto_plan: mesh axis {tp_axis!r} is not in the mesh (axes: {list(names)})")
    n = mesh.size(names.index(tp_axis))
    try:
        trace = trace_model(model, example_call(model, example_inputs))
    except Exception as exc:
        raise PlanError(f"auto_plan: one forward of {type(model).__name__} on meta tensors failed ({type(exc).__name__}: "
                        f"{exc}); pass example_inputs=(...) that its forward takes") from exc
    covered = _covered(model, base)
    towers: list[str] = []
    if not sequence_parallel:  # SP shards one stack of layers: a tower's blocks would be a second one
        trace, towers = trace_towers(model, trace, covered)
    g = _Generator(model, trace, n, tp_axis, allow_uncovered, covered, split_convolutions)
    g.notes += towers
    g.run(sequence_parallel)
    merge_overrides(g.entries, g.roles, overrides, model)
    paths = [p for p, _ in model.named_modules()]
    params = [p for p, _ in model.named_parameters(remove_duplicate=False)]
    if base is None:
        cov = coverage(model, g.entries, g.roles, g.special, g.param_roles, tp_axis)
        return AutoPlan(collapse(g.entries, paths), {"tp": tp_axis}, coverage=cov, notes=tuple(g.notes),
                        settings={"loss_parallel": loss_parallel}, special_handlers=collapse(g.special, params),
                        example_inputs=example_inputs)
    kept = _base_entries(model, base, tp_axis)
    g.roles.update(dict.fromkeys(covered, "planned by the base plan"))
    cov = coverage(model, {**g.entries, **kept}, g.roles, g.special, g.param_roles, tp_axis)
    return AutoPlan({**base.entries, **collapse(g.entries, paths)}, base.axes, coverage=cov, notes=tuple(g.notes),
                    example_inputs=example_inputs,
                    settings={**base.settings, "loss_parallel": loss_parallel or base.settings.get("loss_parallel", False)},
                    special_handlers={**base.special_handlers, **collapse(g.special, params)}, handlers=base.handlers,
                    optional_roles=base.optional_roles, unplanned=base.unplanned, parallelisms=base.parallelisms)


def _base_entries(model: nn.Module, base: ShardingPlan, axis: str) -> dict[str, Style]:
    """Per module path, the base plan's style for it where that style places parameters on
    ``axis`` plainly (what the coverage table can show; the rest is listed as the base's)."""
    out = {}
    for path, m in model.named_modules():
        style = next((s for k, s in base.entries.items() if path_matches(k, path)), None)
        try:
            if style is not None and style.spec(m, path, axis).params is not None:
                out[path] = style
        except Exception:  # noqa: BLE001 - a style the table cannot show (it raises on this module alone)
            continue
    return out


def _covered(model: nn.Module, base: ShardingPlan | None) -> set[str]:
    """The module paths a ``base`` plan's entries reach: those they match and every module below."""
    if base is None:
        return set()
    paths = [p for p, _ in model.named_modules()]
    roots = {p for p in paths if any(path_matches(k, p) for k in base.entries)}
    return {p for p in paths if any(p == r or inside(p, r) for r in roots)}


#: the convolutions' own forwards: a subclass's (Parakeet's CTC head transposes its input) lays out its
#: channels otherwise
_CONV_FORWARDS = (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)


class _Generator:
    """The per-module entries, their roles and the notes, decided rule by rule (``run``)."""

    def __init__(self, model: nn.Module, trace: ModelTrace, n: int, axis: str, allow_uncovered: bool,
                 covered: set[str] = frozenset(), convolutions: bool = False):
        self.model, self.trace, self.n, self.axis, self.allow = model, trace, n, axis, allow_uncovered
        self.covered = covered  # planned by a base plan: left as it is
        self.convolutions = convolutions  # split_convolutions: convolutions pair as projections do
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.total = sum(p.numel() for p in model.parameters())
        self.entries: dict[str, Style] = {}
        self.roles: dict[str, str] = {}  # module path -> the rule that decided it
        self.param_roles: dict[str, str] = {}  # parameter FQN -> a reason of its own
        self.special: dict[str, str] = {}  # parameter FQN -> special handler
        self.notes: list[str] = []
        self.uncovered: list[str] = []
        self.blocks: dict[str, B.Block] = {}

    def run(self, sequence_parallel: bool) -> None:
        skip = self._moe() + sorted(self.covered)
        embed = self._embedding()
        head = self._head(embed)
        self._tie_groups(embed, head)
        projections = [p for p, m in self.modules.items() if self._projection(m) and p != head
                       and not any(inside(p, s) or p == s for s in skip)]
        self._pair_by_dataflow([p for p in projections if p in self.trace.calls], {*projections, head} - {None})
        self._uncalled([p for p in projections if p not in self.trace.calls])
        self._tie_groups(embed, head)  # again: a pair may have taken a projection tied to the table
        self._replicate_blocks_whose_heads_do_not_split()
        errors = [e for blk in self.blocks.values() for e in blk.errors]
        if errors:
            raise PlanError("auto_plan: " + "; ".join(errors))
        self._head_tables_handed_on()
        self._rest(skip)
        self._stored_split(skip)
        if self.uncovered and not self.allow:
            raise PlanError("auto_plan: no rule covers " + "; ".join(self.uncovered) + " (pass allow_uncovered=True to "
                            "leave them replicated, or plan them with overrides={...})")
        if sequence_parallel:
            sequence_parallel_plan(self.entries, self.roles, self.blocks, self.modules, self.trace, head)

    def _projection(self, module: nn.Module | None) -> bool:
        return B.is_projection(module) or (self.convolutions and B.is_channel_conv(module))

    def _tie_groups(self, *planned: str | None) -> None:
        """Every module reading the token table or the head's weight takes the same placement of
        it: a tied ``nn.Embedding`` becomes ``VocabEmbedding``; where a reader cannot (a quantised
        linear, a projection paired rowwise: BLIP's text decoder), the whole group is replicated."""
        by_tensor: dict[int, dict[str, str]] = {}
        for fqn, q in self.model.named_parameters(remove_duplicate=False):
            by_tensor.setdefault(id(q), {})[fqn.rpartition(".")[0]] = fqn.rpartition(".")[2]
        tied = [p for p in planned if p is not None] + sorted(self.entries)
        for path in dict.fromkeys(p for p in tied if p in self.entries and p not in self.covered):
            weight = getattr(self.modules[path], "weight", None)
            readers = by_tensor.get(id(weight), {}) if isinstance(weight, nn.Parameter) else {}
            if len(readers) < 2:
                continue
            for owner in sorted(set(readers) - set(self.entries) - self.covered):
                m = self.modules[owner]
                if isinstance(m, nn.Embedding) and m.num_embeddings % self.n == 0:
                    self.entries[owner], self.roles[owner] = VocabEmbedding(), f"embedding (tied to {path})"
            want = self._placement(path, readers[path])
            odd = sorted(o for o, name in readers.items() if o not in self.covered and self._placement(o, name) != want)
            if not odd:
                continue
            for owner in readers:
                if self.entries.pop(owner, None) is not None:
                    self.roles[owner] = f"tied to {odd[0]}, which cannot hold it alike (replicated)"
                bias = getattr(self.modules[owner], "bias", None)
                for fqn in [f for f in self.special if bias is not None and self.model.get_parameter(f) is bias]:
                    del self.special[fqn]
            self.notes.append(f"{path}: its weight is also read by {odd[0]} ({type(self.modules[odd[0]]).__name__}), "
                              "which cannot hold it sharded alike: the tied group is replicated")

    def _placement(self, owner: str, name: str):
        """The placement ``owner``'s entry gives its parameter ``name`` on the axis (None: unplanned)."""
        style = self.entries.get(owner)
        if style is None:
            return None
        return style.spec(self.modules[owner], owner, self.axis).params.get(name, {}).get(self.axis)

    # -------------------------------------------------------------- rule 4
    def _pair_by_dataflow(self, called: list[str], projections: set[str]) -> None:
        """Pair the called projections colwise → rowwise in the smallest module that holds both
        ends (their parent first: Llama's ``self_attn``; else an ancestor: BERT's ``attention``
        holds ``self.query`` and ``output.dense``), deepest scopes first; what pairs nowhere is a
        lone projection, left replicated."""
        pending, cache = set(called), {}
        scopes = sorted({a for p in called for a in _ancestors(p)}, key=lambda a: (-a.count(".") if a else 1, a))
        for scope in scopes:
            members = [p for p in called if p in pending and inside(p, scope)]
            if not members:
                continue
            roles, between, _ = B.pair(self.trace, scope, self.modules, members, projections)
            if not roles:
                continue
            pending -= set(roles)
            if uneven := [p for p, r in roles.items() if B.split_width(self.modules[p], r) % self.n]:
                for p in roles:
                    self.entries[p], self.roles[p] = NoParallel(), "replicated: its pair's features do not divide the axis"
                self.notes.append(f"{scope}: {uneven[0]}'s features do not split over {self.n} ranks; its pair is "
                                  "left replicated")
                continue
            self._add_block(B.plan_block(self.trace, self.model, scope, roles, between, self.n, self.axis, cache))
        for p in sorted(pending):
            self._lone(p)

    def _lone(self, p: str) -> None:
        """A projection that pairs with no other: ``Colwise(gather_output=True)`` where its output
        features divide the axis and it is worth an all-gather (``_worth_splitting``): exact for any
        projection, each rank computing its share of the output features; else (and a MoE router,
        whose scores a routing op takes) replicated."""
        routes = any(p in r.sources for r in self.trace.routes)  # a router: its scores pick experts, kept whole
        if not routes and B.out_features(self.modules[p]) % self.n == 0 and self._worth_splitting(p):
            self.entries[p] = Colwise(gather_output=True)
            self.roles[p] = "lone projection (colwise, output gathered: it pairs with no other)"
            return
        self.entries[p], self.roles[p] = NoParallel(), "lone projection (replicated: it pairs with no other)"
        self.notes.append(f"{p}: a lone projection (no colwise/rowwise partner in the traced forward), replicated")

    def _worth_splitting(self, path: str) -> bool:
        """Whether ``path``'s own parameters hold 1 % of the model's or more, the traced forward took
        them in its own forward only (``ModelTrace.param_users``: a weight read elsewhere, tied or
        sliced by a parent, cannot follow its module's style) and no integer attribute of it shaped a
        tensor (a split divides its sizes on the skeleton)."""
        own = list(self.modules[path].named_parameters(recurse=False))
        if sum(q.numel() for _, q in own) * 100 < self.total or path not in self.trace.calls:
            return False
        if any(owner == path for c in self.trace.shape_calls for owner, _ in c.attrs):
            return False  # its sizes shape something (Whisper's arange(embed_positions.num_embeddings))
        return all(self.trace.param_users.get(join(path, n), set()) <= {path} for n, _ in own)

    def _stored_split(self, skip: list[str]) -> None:
        """Rule 8: a module left replicated whose own parameters hold 1 % of the model or more, tied to
        nothing, trained (not a frozen table: RoFormer's sinusoidal positions), each splitting on dim 0
        (an LSTM, a grouped convolution, a position table read whole by its parent, a tower the batch
        does not reach): ``ShardedParams``.  Its parameters are gathered
        into their slots before the forward, so whoever reads them (its forward, a parent, no one) sees
        them whole: exact as ``NoParallel``.  Norms stay replicated (small; sequence parallelism plans them)."""
        names = Counter(id(q) for _, q in self.model.named_parameters(remove_duplicate=False))  # a tied tensor: left alone
        for path, m in self.modules.items():
            style = self.entries.get(path)
            if (not path or path in self.covered or any(path == s or inside(path, s) for s in skip) or B.is_norm(m)
                    or (style is not None and style != NoParallel()) or path in self.blocks):
                continue
            own = list(m.named_parameters(recurse=False))
            if not own or any(q.dim() == 0 or q.shape[0] % self.n or names[id(q)] > 1 or join(path, k) in self.special
                              or not q.requires_grad for k, q in own) or sum(q.numel() for _, q in own) * 100 < self.total:
                continue
            self.entries[path] = ShardedParams()
            self.roles[path] = "stored split on dim 0, gathered whole for its compute (ShardedParams: TP cannot split it)"
            for k, _ in own:
                self.param_roles.pop(join(path, k), None)

    def _replicate_blocks_whose_heads_do_not_split(self) -> None:
        """An attention block whose heads do not split over the axis (a vision pyramid's 1-head first
        stage; 6 heads over 4 ranks) is computed whole, noted, while the rest of the model shards: its
        projections are left to rule 8 (stored split, gathered: ``ShardedParams``), exact as replicated.
        ``PlanError`` only where nothing else of the model would shard (every projection in such a block)."""
        bad = {path for path, blk in self.blocks.items() if blk.errors}
        if not bad or all(path in bad for path in self.blocks):
            return
        for path in sorted(bad):
            blk = self.blocks[path]
            for p in blk.roles:
                if self._projection(self.modules.get(p)):
                    self.entries[p], self.roles[p] = NoParallel(), "computed whole: the heads of its block do not split"
            self.notes.append(f"{path}: {blk.errors[0]}; computed whole (the rest of the model shards)")
            blk.errors = []

    def _add_block(self, blk: B.Block) -> None:
        if blk.uncovered:  # a module between the pair that no rule splits: the pair stays replicated (exact)
            why = ", ".join(blk.uncovered)
            for p in (p for p in blk.roles if self._projection(self.modules.get(p))):
                self.entries[p], self.roles[p] = NoParallel(), "replicated: a module between its pair has no rule"
            self.notes.append(f"{blk.path}: {why}: no rule splits it, so the pair around it is left replicated "
                              "(plan it with overrides={...} to shard it)")
            return
        self.blocks[blk.path] = blk
        self.entries.update(blk.styles)
        self.roles.update(blk.roles)
        self.special.update({q: "shard_heads" if self.model.get_parameter(q).dim() == 1 else "shard_last"
                             for q in blk.per_head})
        self.param_roles.update(blk.param_roles)
        self.notes += blk.notes
        self.uncovered += blk.uncovered

    def _head_tables_handed_on(self) -> None:
        """A table outside the blocks whose per-head output the head-split blocks take (``shared_head_tables``):
        its columns split with their heads."""
        heads = {p: frozenset(h for q in blk.roles for h in B.heads_of(self.trace, q))  # counts its views split
                 for p, blk in self.blocks.items() if blk.heads}  # into (not an attribute's: RoFormer's head size)
        for q in shared_head_tables(self.trace, self.modules, heads, self.blocks, self.n):
            self.special[q], self.param_roles[q] = "shard_last", "per-head table handed to the blocks (its heads split)"
            self.roles[q.rpartition(".")[0]] = "per-head table handed to the blocks (columns split)"

    def _uncalled(self, uncalled: list[str]) -> None:
        """Projections the traced forward never calls (a decoder's cross-attention without an
        encoder): planned as a called module of the same class is, else replicated."""
        for p in uncalled:
            if p in self.entries:
                continue
            twin = self._planned_twin(p)
            if twin is None:
                self.entries[p], self.roles[p] = NoParallel(), "not called by the traced forward (replicated)"
                self.notes.append(f"{p}: not called by the traced forward, replicated")
                continue
            owner, source = twin
            blk = self.blocks[source]
            for path, style in blk.styles.items():
                mine = owner + path[len(source):]
                self.entries[mine] = style
                self.roles[mine] = f"{blk.roles.get(path, 'planned')} (as {path}: not called by the traced forward)"
            self.notes.append(f"{owner}: not called by the traced forward; planned as {source}, a module of its class")

    def _planned_twin(self, path: str) -> tuple[str, str] | None:
        """(an ancestor of ``path``, a planned block of the same class and parameter shapes)."""
        for owner in _ancestors(path)[:-1]:
            mine = self.modules[owner]
            shapes = [(k, tuple(v.shape)) for k, v in mine.named_parameters()]
            for source in [b for b in self.blocks if b != owner]:
                other = self.modules[source]
                if type(other) is type(mine) and [(k, tuple(v.shape)) for k, v in other.named_parameters()] == shapes:
                    return owner, source
        return None

    # -------------------------------------------------------------- rules 1-3
    def _moe(self) -> list[str]:
        """Mixture-of-experts blocks, found from real routing: a top-k (or argmax, sort) of a
        module-computed score, and in the same module (or one that holds it) experts the selected
        tokens are dispatched to (stacked weights, or an ``nn.ModuleList`` of like modules called
        on routed data).  The block is the smallest module holding both; names play no part."""
        found: list[str] = []
        for route in [r for r in self.trace.routes if r.module not in self.covered]:
            for scope in [route.module, *_ancestors(route.module)]:
                if any(self._dispatches(e) for e in self.modules if (e == scope or inside(e, scope)) and e not in self.covered):
                    if not any(scope == f or inside(scope, f) for f in found):
                        found = [f for f in found if not inside(f, scope)] + [scope]
                    break
        skip, unplanned = [], []
        for path in found:
            experts, why = self._experts_in(path)
            if why is None:
                for e in experts:
                    self.entries[e] = Experts(axis=self.axis)
                    self.roles[e] = f"MoE experts (expert parallel: Experts over {self.axis!r}, each rank its share of them)"
                skip += experts
            else:
                unplanned.append((path, why))
        if unplanned and not self.allow:
            path, why = unplanned[0]
            raise PlanError(f"auto_plan: {path or '<root>'} ({type(self.modules[path]).__name__}) is a mixture of "
                            f"experts (its forward routes tokens with a top-k and dispatches them to experts) whose "
                            f"experts auto_plan cannot shard ({why}): plan them with an hpf.Experts entry or "
                            "ShardingPlan.from_hf(model, ep_axis=...) (docs/experts.md); allow_uncovered=True leaves "
                            "it replicated")
        for path, _ in unplanned:
            self.entries[path] = NoParallel()
            self.roles[path] = "MoE (replicated: its experts are not in a form hpf.Experts takes)"
            self.notes.append(f"{path or '<root>'}: MoE left replicated")
        return skip + [p for p, _ in unplanned]

    def _experts_in(self, block: str) -> tuple[list[str], str | None]:
        """The experts modules of MoE ``block`` that ``Experts`` shards over the axis (fused
        ``[num_experts, ...]`` weights, or a container of expert modules whose forward takes the
        routing), and None; or why it cannot (experts in another form, a count that does not divide)."""
        inner = [e for e in self.modules if (e == block or inside(e, block)) and e not in self.covered]
        experts = [e for e in inner if is_experts(self.modules[e]) and self._dispatches(e)]
        experts = [e for e in experts if not any(inside(e, o) for o in experts)]
        if not experts:
            kinds = sorted({type(self.modules[e]).__name__ for e in inner if self._dispatches(e)})
            return [], (f"{', '.join(kinds) or 'its experts'}: neither stacked [num_experts, ...] weights nor a "
                        "container of expert modules whose forward takes the routing")
        for e in experts:
            m = self.modules[e]
            count = getattr(m, "num_experts", None) if expert_weights(m) else len(expert_members(m))
            if not count or count % self.n:
                return [], f"{e}: {count} experts do not split over {self.n} ranks of axis {self.axis!r}"
            shared = not_per_expert(m) if expert_weights(m) else []
            if shared:
                return [], f"{e}: {shared} under the experts are not per-expert parameters"
        return experts, None

    def _dispatches(self, path: str) -> bool:
        """Whether ``path`` holds experts that routed tokens are dispatched to."""
        m = self.modules[path]
        call = self.trace.calls.get(path)
        if call is not None and call.opaque:  # it held experts and failed dispatching routed tokens on meta
            return True
        stacked = not isinstance(m, nn.modules.conv._ConvNd) and any(p.dim() >= 3 for p in m.parameters(recurse=False))
        if stacked and call is not None and (call.routed or path in self.trace.dispatch):
            return True
        lists = [(name, c) for name, c in m.named_children() if isinstance(c, nn.ModuleList) and len(c) > 1
                 and len({type(x) for x in c}) == 1]
        return any(getattr(self.trace.calls.get(join(path, name, str(i))), "routed", False)
                   for name, c in lists for i in range(len(c)))

    def _path_of(self, module) -> str | None:
        return next((p for p, m in self.modules.items() if m is module), None)

    def _embedding(self) -> str | None:
        get = getattr(self.model, "get_input_embeddings", None)
        try:
            path = self._path_of(get()) if get else None
        except (NotImplementedError, AttributeError):
            path = None
        declared = path is not None and isinstance(self.modules[path], nn.Embedding)
        if not declared:
            path = next((p for p in self.trace.calls if isinstance(self.modules.get(p), nn.Embedding)
                         and INPUT in self.trace.producers(p)), None)
        if path is None:
            return None
        if path in self.covered:
            return path
        rows = self.modules[path].num_embeddings
        if rows % self.n and not declared:  # a table the inputs index that is no vocabulary (DiT's class labels)
            self.roles[path] = f"input embedding (replicated: {rows} rows do not split over {self.n} ranks)"
            return None
        if rows % self.n:  # exact replicated; sharding it is the user's choice of padding
            self.roles[path] = f"embedding (replicated: a vocabulary of {rows} does not split over {self.n} ranks)"
            self.notes.append(f"{path}: a vocabulary of {rows} does not split over {self.n} ranks of axis {self.axis!r}: "
                              f"replicated (pad it to a multiple of {self.n} to shard it)")
            return None
        self.entries[path], self.roles[path] = VocabEmbedding(), "embedding"  # its tied readers: _tie_groups
        return path

    def _head(self, embed: str | None) -> str | None:
        get = getattr(self.model, "get_output_embeddings", None)
        try:
            path = self._path_of(get()) if get else None
        except (NotImplementedError, AttributeError):
            path = None
        if path is not None and not B.is_projection(self.modules[path]):
            path = None  # not one projection (MusicGen's ModuleList of per-codebook heads): its parts are planned as found
        if path is None and embed is not None:
            vocab = self.modules[embed].num_embeddings  # a projection the model returns, as wide as the vocabulary
            returned = self.trace.calls[""].outputs if "" in self.trace.calls else set()
            path = next((p for p in sorted(returned) if B.is_projection(self.modules.get(p))
                         and B.out_features(self.modules[p]) == vocab), None)
        if path is None or path in self.covered:
            return path
        if (width := B.out_features(self.modules[path])) % self.n:
            self.roles[path] = f"output head (replicated: {width} output features do not split over {self.n} ranks)"
            self.notes.append(f"{path}: {width} output features do not split over {self.n} ranks of axis {self.axis!r}: "
                              f"replicated (pad the vocabulary to a multiple of {self.n} to shard it)")
            self.entries[path] = NoParallel()  # planned as replicated: no pairing takes it
            return path
        self.entries[path], self.roles[path] = Colwise(gather_output=True), "output head"
        bias = getattr(self.modules[path], "bias", None)
        for fqn, q in self.model.named_parameters(remove_duplicate=False):  # BERT: cls.predictions.bias is the head's
            if bias is not None and q is bias and fqn != join(path, "bias"):
                self.special[fqn], self.param_roles[fqn] = "shard_heads", f"output head bias (tied to {path}.bias)"
        return path

    def _lookup_splits(self, path: str) -> bool:
        """Whether an ``nn.Embedding`` outside the token table is worth splitting by rows and can be
        (``VocabEmbedding``: its class's own lookup, no ``max_norm`` or ``scale_grad_by_freq``, rows
        dividing the axis, ``_worth_splitting``)."""
        m = self.modules[path]
        return (type(m).forward is nn.Embedding.forward and m.max_norm is None and not m.scale_grad_by_freq
                and not m.sparse and m.num_embeddings % self.n == 0 and self._worth_splitting(path)
                and not self._feeds_a_block(path))

    def _feeds_a_block(self, path: str) -> bool:
        """Whether ``path``'s output (or its parent's, where it is the parent's output) goes straight
        into a planned block (SpeechT5's relative positions into each attention): a value split there
        per rank would need its gradient summed over the ranks, which only a planned entry decides."""
        parent = path.rpartition(".")[0]
        users = set(self.trace.consumers.get(path, ()))
        if parent in self.trace.calls and path in self.trace.calls[parent].main:
            users |= self.trace.consumers.get(parent, set())
        return any(u == path or (path and inside(u, path)) or any(u == p or inside(u, p) for p in blk.roles)
                   for u in users for path, blk in self.blocks.items())

    # -------------------------------------------------------------- rules 5-7
    def _rest(self, skip: list[str]) -> None:
        total = sum(p.numel() for p in self.model.parameters())
        for path, m in self.modules.items():
            if path in self.entries or path in self.roles or any(path == s or inside(path, s) for s in skip):
                continue
            own = list(m.named_parameters(recurse=False))
            if not own or path in self.blocks:
                continue
            if B.is_norm(m):
                self.roles[path] = "norm (replicated)"
            elif isinstance(m, nn.Embedding) and self._lookup_splits(path):
                self.entries[path] = VocabEmbedding()
                self.roles[path] = "auxiliary embedding (rows split, each rank's lookups all-reduced)"
            elif isinstance(m, nn.Embedding):
                self.roles[path] = "auxiliary embedding (positions, types: replicated)"
            elif (B.is_channel_conv(m) and type(m).forward in _CONV_FORWARDS and m.out_channels % self.n == 0
                  and self._worth_splitting(path)):
                self.entries[path] = Colwise(gather_output=True)
                self.roles[path] = "convolution (output channels split, gathered: it pairs with no other)"
            elif isinstance(m, nn.modules.conv._ConvNd):
                self.roles[path] = ("convolution (replicated: split its channels with overrides={...}: Colwise() on it, "
                                    "Channels() on the norm or depthwise convolution after it, Rowwise() on the next one)")
            else:
                for name, q in own:
                    big = q.dim() >= 2 or q.numel() * 100 >= total
                    self.param_roles[join(path, name)] = ("other parameter (replicated: on the residual stream, outside "
                                                          "any projection pair)" if big else "small parameter (replicated)")
