"""torchtitan 0.3.0's declarative sharding (``ShardingConfig`` on each module) as plan entries.

torchtitan 0.3.0 no longer hands ``{pattern: style}`` dicts to ``parallelize_module``: its
``set_*_sharding_config`` functions put a ``ShardingConfig`` on every sub-config of the model's
config, ``config.build()`` copies each onto its module (``module._sharding_config``), and
``Module.parallelize`` applies them.  Each config states, in spmd_types layouts keyed by mesh
axis name, how the module's parameters are stored (``state_shardings``), how its inputs arrive
and are needed (``in_src``/``in_dst_shardings``, by forward argument name) and how its output
is produced and handed on (``out_src``/``out_dst_shardings``) — the same contract as a
``ModuleSpec`` here.  ``torchtitan_entries`` reads the ``tp`` part of every config (the model
is only read; torchtitan is never imported: configs and layouts are recognised by their
attributes) and writes the style here with the same placements:

* ``nn.Embedding`` with the table Shard(0) → ``VocabEmbedding`` (torchtitan's vocab-parallel
  lookup), its output all-reduced or reduce-scattered onto the sequence;
* ``nn.Linear`` with the weight Shard(0) → ``Colwise``, Shard(1) → ``Rowwise``; the model's
  ``lm_head`` gathers its logits unless ``loss_parallel``;
* a norm (1-D parameters) on a sequence-sharded input → ``SequenceParallel``;
* any other module (attention and MoE blocks, the inner attention's head-sharded q/k/v, the
  routed experts' local region and their stacked weights) → a ``ModuleSpec`` of the same
  placements; a module with head counts (``n_heads``, ``n_kv_heads``) holds them divided on
  the skeleton's copy, so a count the axis does not divide is refused at ``shard()``.

Layout types: ``R`` and ``I`` (replicated; whether the gradient is reduced is derived here, not
declared) → Replicate, ``P`` → Partial, ``S(d)`` → Shard(d), ``V`` with a partition spec naming
``tp`` on dim d → Shard(d).  Only the ``tp`` axis is converted: the ``dp``/``cp`` entries
(batch and sequence sharding of activations, replicated parameters) are this library's data and
context parallelism, planned separately.  Expert parallelism (``enable_ep=True``: routed
experts Shard(0) on ``ep``, tokens sequence-sharded over the ``tp`` ranks) and anything else
that cannot be expressed raises a ``PlanError`` naming the module and the layout.
"""

from __future__ import annotations

__all__ = ["torchtitan_entries"]

import inspect
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..core.errors import PlanError
from ..core.style import ModuleSpec, Style
from ..parallel.tensor.styles import Colwise, Rowwise, SequenceParallel
from ..parallel.tensor.vocab import VocabEmbedding
from .torch_styles import head_counts

#: torchtitan's expert-parallel mesh axes: a layout sharding a tensor on one is expert parallelism.
_EP_AXES = ("ep", "efsdp")


def _config(module: nn.Module) -> Any | None:
    """The module's torchtitan ``ShardingConfig`` (``_sharding_config``), recognised by its fields."""
    config = getattr(module, "_sharding_config", None)
    if config is None or not hasattr(config, "state_shardings") or not hasattr(config, "out_dst_shardings"):
        return None
    return config


def _axis_types(layout: Any, where: str) -> dict[str, Any]:
    """``{axis name: spmd type}`` of a torchtitan ``SpmdLayout``, a partition spec's sharded dims as ``S(d)``."""
    per_axis = getattr(layout, "per_axis_spmd_types", None)
    if not callable(per_axis):
        raise PlanError(f"{where}: {layout!r} is not a torchtitan SpmdLayout")
    return {str(getattr(axis, "value", axis)): t for axis, t in per_axis().items()}


def _tp_name(layout: Any) -> str | None:
    """The name of a layout's tp type (``"R"``, ``"I"``, ...), None for a Shard or no layout."""
    if layout is None or isinstance(layout, tuple) or not callable(getattr(layout, "per_axis_spmd_types", None)):
        return None
    return getattr(_axis_types(layout, "").get("tp"), "name", None)


def _placement(layout: Any, where: str) -> Placement | None:
    """The tp placement of a torchtitan layout (None: the layout declares nothing on tp)."""
    if layout is None:
        return None
    if isinstance(layout, tuple):
        raise PlanError(f"{where}: a layout per output ({len(layout)} outputs) cannot be expressed here; "
                        "only a single tensor output is converted")
    types = _axis_types(layout, where)
    for axis in _EP_AXES:
        if type(types.get(axis)).__name__ == "Shard":
            raise PlanError(f"{where}: {layout!r} shards over torchtitan's {axis!r} axis: its expert parallelism "
                            "(enable_ep=True; tokens sequence-sharded over the tp ranks) has no counterpart here; build "
                            "the config with enable_ep=False (experts TP) or plan hpf.Experts() on the routed experts "
                            "by hand")
    t = types.get("tp")
    if t is None:
        return None
    if type(t).__name__ == "Shard":
        return Shard(t.dim)
    name = getattr(t, "name", None)
    if name in ("R", "I"):
        return Replicate()
    if name == "P":
        return Partial()
    raise PlanError(f"{where}: tp type {t!r} of {layout!r} cannot be expressed here "
                    "(supported: R, I, P, S(d), V with a partition spec naming tp)")


def _layouts(config: Any, module: nn.Module, fqn: str) -> dict[str, Any]:
    """The tp placements of one module's config: params, buffers, inputs and the output."""
    where = f"{fqn or '<root module>'} ({type(module).__name__})"
    own = dict(module.named_parameters(recurse=False))
    buffers = dict(module.named_buffers(recurse=False))
    params, in_src, in_dst = {}, {}, {}
    for name, layout in config.state_shardings.items():
        p = _placement(layout, f"{where} state_shardings[{name!r}]")
        if name in own:
            if p is not None:
                params[name] = p
        elif name in buffers and p is not None and not isinstance(p, Replicate):
            raise PlanError(f"{where}: buffer {name!r} is {p} on tp ({layout!r}); only replicated buffers are "
                            "converted (torchtitan's MoE counts tokens per tp rank under enable_ep=True, whose expert "
                            "parallelism has no counterpart here: build the config with enable_ep=False)")
    for name, layout in (config.in_src_shardings or {}).items():
        if (p := _placement(layout, f"{where} in_src_shardings[{name!r}]")) is not None:
            in_src[_arg(module, name)] = p
    for name, layout in (config.in_dst_shardings or {}).items():
        if (p := _placement(layout, f"{where} in_dst_shardings[{name!r}]")) is None:
            continue
        name = _arg(module, name)
        if name not in in_src:
            raise PlanError(f"{where}: in_dst_shardings[{name!r}] = {layout!r} has no in_src_shardings entry: the "
                            "placement it arrives in must be declared")
        in_dst[name] = p
    out_src = _placement(config.out_src_shardings, f"{where} out_src_shardings")
    out_dst = _placement(config.out_dst_shardings, f"{where} out_dst_shardings")
    if out_dst is not None and out_src is None:
        raise PlanError(f"{where}: out_dst_shardings {config.out_dst_shardings!r} has no out_src_shardings: the "
                        "placement the output is produced in must be declared")
    # I -> R: replicated, and from here on its gradient is a per-rank partial sum (Megatron's f):
    # the module is the entry of a rank-varying region even where both sides are Replicate here
    entry = {_arg(module, n) for n, layout in (config.in_dst_shardings or {}).items()
             if _tp_name((config.in_src_shardings or {}).get(n)) == "I" and _tp_name(layout) == "R"}
    in_src.pop(None, None)
    in_dst.pop(None, None)
    in_dst = {**in_src, **in_dst}  # an input without a destination is an annotation: no redistribution
    return {"where": where, "entry": entry - {None}, "params": params, "in_src": in_src, "in_dst": in_dst, "out_src": out_src,
            "out_dst": out_dst if out_dst is not None else out_src}


def _arg(module: nn.Module, name: str) -> str | int | None:
    """The forward argument a config's input name means: the name when ``forward`` has it; else
    argument 0 when ``forward`` takes one positional argument (torchtitan writes ``"input"``, the
    name of ``nn.Linear``'s, for norms whose forward calls it ``x``); else None — torchtitan binds
    inputs by ``forward``'s names and skips one it does not have, and so is it skipped here."""
    params = [p for p in inspect.signature(type(module).forward).parameters.values() if p.name != "self"]
    if any(p.name == name for p in params):
        return name
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 0 if len(positional) == 1 else None


def _last(p: Placement | None) -> Placement | None:
    """A Linear's feature dim as Shard(-1): torchtitan writes S(2) for the (B, L, F) activations of MoE."""
    return Shard(-1) if isinstance(p, Shard) and p.dim in (-1, 2) else p


def _linear(module: nn.Linear, lay: dict, head: bool, loss_parallel: bool) -> Style | None:
    where, params = lay["where"], lay["params"]
    weight = params.get("weight", Replicate())
    bias = params.get("bias") if module.bias is not None else None
    arg = lay["in_src"].get("input", lay["in_src"].get(0))
    need = _last(lay["in_dst"].get("input", lay["in_dst"].get(0)))
    out_src, out_dst = _last(lay["out_src"]), _last(lay["out_dst"])
    if weight == Shard(0):
        if bias not in (None, Shard(0)) or need not in (None, Replicate()) or out_src not in (None, Shard(-1)):
            raise PlanError(f"{where}: weight Shard(0) with bias {bias}, input needed {need}, output {out_src} is no "
                            "column-parallel linear (bias Shard(0), input Replicate, output Shard(-1))")
        output = out_dst or Shard(-1)
        if head and not loss_parallel:
            output = Replicate()  # the logits gathered; loss_parallel=True keeps them vocab-sharded
        return Colwise(input_layout=arg or Replicate(), output_layout=output)
    if weight == Shard(1):
        if bias not in (None, Replicate()) or need not in (None, Shard(-1)) or out_src not in (None, Partial()):
            raise PlanError(f"{where}: weight Shard(1) with bias {bias}, input needed {need}, output {out_src} is no "
                            "row-parallel linear (bias Replicate, input Shard(-1), output Partial)")
        return Rowwise(input_layout=_last(arg) or Shard(-1), output_layout=out_dst or Partial())
    if weight != Replicate() or bias not in (None, Replicate()):
        raise PlanError(f"{where}: weight {weight}, bias {bias} on tp cannot be expressed for a Linear "
                        "(supported: weight Shard(0), Shard(1) or Replicate)")
    return None  # replicated: the generic spec below carries its boundaries


def _style(module: nn.Module, lay: dict, *, head: bool, loss_parallel: bool, tp_axis: str) -> Style | None:
    """The style for one module's tp placements (None: nothing to plan)."""
    where, params = lay["where"], lay["params"]
    in_src, in_dst, out_src, out_dst = lay["in_src"], lay["in_dst"], lay["out_src"], lay["out_dst"]
    if isinstance(module, nn.Embedding):
        weight = params.get("weight", Replicate())
        if weight == Shard(0):
            if any(p != Replicate() for p in (*in_src.values(), *in_dst.values())) or out_src not in (None, Partial()):
                raise PlanError(f"{where}: a vocab-sharded table takes the ids replicated and makes a partial sum; "
                                f"got inputs {in_src} -> {in_dst}, output {out_src}")
            if out_dst not in (None, Partial(), Replicate(), Shard(1)):
                raise PlanError(f"{where}: the embedding's output {out_dst} cannot be expressed "
                                "(supported: Replicate, Shard(1))")
            return VocabEmbedding(output_layout=Replicate() if out_dst in (None, Partial()) else out_dst)
        if weight != Replicate():
            raise PlanError(f"{where}: embedding table {weight} on tp cannot be expressed (supported: Shard(0) over "
                            "the vocabulary, Replicate)")
    if isinstance(module, nn.Linear):
        style = _linear(module, lay, head, loss_parallel)
        if style is not None:
            return style
    own = dict(module.named_parameters(recurse=False))
    seq = in_src.get("input", in_src.get(0))
    if (own and all(p.dim() == 1 for p in own.values()) and all(p == Replicate() for p in params.values())
            and len(in_src) == 1 and seq == Shard(1) and in_dst.get("input", seq) == seq and out_src == seq):
        return SequenceParallel(seq_dim=1, output_layout=None if out_dst == seq else out_dst)
    if (not lay["entry"] and not any(p != Replicate() for p in params.values())
            and all(p == Replicate() for p in (*in_src.values(), *in_dst.values()))
            and out_src in (None, Replicate()) and out_dst in (None, Replicate())):
        return None  # replicated in and out: nothing to plan
    if isinstance(out_dst, Partial) and not isinstance(out_src, Partial):
        raise PlanError(f"{where}: output {out_src} -> {out_dst} has no redistribution (nothing becomes a partial sum)")
    return ModuleSpec(
        params={n: {tp_axis: p} for n, p in params.items() if p != Replicate()},
        in_src={k: {tp_axis: p} for k, p in in_src.items()}, in_dst={k: {tp_axis: p} for k, p in in_dst.items()},
        out_src={"output": {tp_axis: out_src}} if out_src is not None else {},
        out_dst={"output": {tp_axis: out_dst}} if out_dst is not None else {},
        divide_attrs=head_counts(module))


def torchtitan_entries(model: nn.Module, tp_axis: str = "tp", *, loss_parallel: bool = False) -> dict[str, Style]:
    """``{module path: style}`` for every module of a torchtitan 0.3.0 model whose ``ShardingConfig``
    shards something or re-places a value on ``tp`` (module doc); a PlanError names the module and
    the layout that cannot be expressed, or says the model declares no sharding.  ``model`` is only
    read; ``tp_axis`` names torchtitan's ``tp`` axis in the mesh; ``loss_parallel`` keeps the
    ``lm_head``'s logits vocab-sharded (else gathered)."""
    head = getattr(model, "lm_head", None)
    entries: dict[str, Style] = {}
    declared = 0
    for fqn, module in model.named_modules():
        config = _config(module)
        if config is None:
            continue
        declared += 1
        style = _style(module, _layouts(config, module, fqn), head=module is head, loss_parallel=loss_parallel,
                       tp_axis=tp_axis)
        if style is not None:
            entries[fqn] = style
    if not declared:
        raise PlanError(f"{type(model).__name__} declares no torchtitan sharding (no module has a _sharding_config): "
                        "build it from a config its set_*_sharding_config function filled (torchtitan 0.3.0 does this "
                        "in Model.Config.update_from_config), or plan it with from_torch / by hand")
    if head is not None and loss_parallel and not isinstance(entries.get(_path(model, head)), Colwise):
        raise PlanError("loss_parallel: the model's lm_head is not vocab-sharded (Colwise) by its sharding config")
    return entries


def _path(model: nn.Module, target: nn.Module) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None)
