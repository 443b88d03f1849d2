"""The shape audit (lint ``head-attr``/``shape``): every planned region run at global and at local
shapes on meta tensors (``analysis.audit``), op by op; a region it cannot run is a ``not-audited``
note, never skipped silently.  The model is read, never run or mutated; nothing communicates.
See docs/guarantees.md#exact-or-refused-the-shape-audit.
"""

from __future__ import annotations

__all__ = ["audit_regions", "fingerprint"]

import inspect
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ..analysis.arguments import head_counts, per_head_arguments
from ..analysis.audit import Mismatch, boundaries, compare, culprits, handoff, record
from ..analysis.trace import example_call, trace_model
from ..core.errors import PlanError
from ..core.module_kinds import CONVS, is_conv1d
from ..core.placement import local_layout, mesh_placements, splits
from ..core.program import Planned
from ..core.style import ModuleSpec

Found = tuple[str, str, str]  # (module, code, message)


def _input_shape(module: nn.Module) -> tuple[int, ...] | None:
    """The shape of a small input ``module`` takes: ``(1, 4, width)`` for the last dim of its first
    Linear's, Conv1D's or 1-D weight's, ``(1, channels, 16, ...)`` for its first convolution's."""
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) or is_conv1d(m):
            return (1, 4, m.weight.shape[0] if is_conv1d(m) else m.in_features)
        if isinstance(m, CONVS):
            return (1, m.in_channels, *(16,) * len(m.kernel_size))
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return (1, 4, weight.shape[0])
    return None


def _one_tensor_forward(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def _sharded_child(p: Planned, spec: ModuleSpec) -> bool:
    """A planned projection (or channel-split convolution) whose output is handed on sharded or
    that needs its input sharded."""
    if not (isinstance(p.module, (nn.Linear, *CONVS)) or is_conv1d(p.module)) or not any(
            splits(pl.get(p.axis)) for pl in spec.params.values()):
        return False
    out = spec.out_dst.get("output", spec.out_src.get("output", {})).get(p.axis)
    return splits(out) or any(splits(pl.get(p.axis)) for pl in spec.in_dst.values())


class Memo:
    """A small bounded memo (least recently used out): the same model built again and sharded
    again (tests, notebooks) is traced and audited once per process.  Keys hold everything the
    result depends on — classes, shapes, dtypes, scalar attributes, the config — never ids."""

    def __init__(self, size: int = 16):
        self.size, self.items = size, OrderedDict()

    def get(self, key, make):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = make()
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_TRACES, _AUDITS = Memo(), Memo(64)


def _scalars(obj) -> tuple:
    return tuple(sorted((k, v) for k, v in vars(obj).items() if isinstance(v, (int, float, str, bool, type(None)))))


def fingerprint(model: nn.Module) -> tuple:
    """What one meta forward of ``model`` depends on, short of its code: module classes and
    scalar attributes, parameter and buffer shapes and dtypes, its config."""
    config = getattr(model, "config", None)
    return (tuple((n, type(m), _scalars(m)) for n, m in model.named_modules()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(remove_duplicate=False),
                                                            *model.named_buffers(remove_duplicate=False))),
            repr(sorted(config.to_dict().items())) if hasattr(config, "to_dict") else None,
            getattr(config, "_attn_implementation", None))


def _trace_calls(model: nn.Module) -> tuple[dict, str]:
    try:
        return trace_model(model, example_call(model)).calls, ""
    except Exception as exc:  # noqa: BLE001 - recorded as the reason a region is not audited
        return {}, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class _Inputs:
    """The arguments of a region's first call: from one meta forward of the whole model (traced
    once, lazily), else synthesized for a one-tensor forward."""

    def __init__(self, model: nn.Module):
        self.model, self._trace, self.why = model, None, ""

    def of(self, path: str, module: nn.Module, shape: tuple[int, ...] | None) -> tuple[tuple, dict] | None:
        if self._trace is None:
            self._trace, self.why = _TRACES.get(fingerprint(self.model), lambda: _trace_calls(self.model))
        call = self._trace.get(path)
        if call is not None:
            return call.args, call.kwargs
        if shape and _one_tensor_forward(module):
            return (torch.empty(shape, device="meta"),), {}
        return None


def audit_regions(model: nn.Module, mesh: DeviceMesh, planned: Sequence[Planned], specs: Mapping[str, ModuleSpec],
                  skip: Sequence[str] = (), rules: Mapping[str, Mapping] | None = None,
                  named: Collection[str] = ()) -> tuple[list[Found], list[tuple[str, str]]]:
    """(errors as ``(module, code, message)``, regions not audited as ``(module, why)``) of every
    region (the parent of planned projections whose output stays sharded or whose input arrives
    sharded), each run at global and at local shapes with those projections opaque, identical
    layers once; ``skip``: planned modules left out (the output head: its
    logits are the loss's, checked by ``loss_parallel``); ``rules``: parameter FQN → per-axis
    placement of the plan's special handlers (per-head parameters); ``named``: regions another
    lint check already refuses (not run again)."""
    by_fqn = {p.fqn: p for p in planned if p.fqn in specs}
    regions: dict[str, list[str]] = {}
    for fqn, p in by_fqn.items():
        if fqn and fqn not in skip and _sharded_child(p, specs[fqn]):
            regions.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    modules, inputs, seen = dict(model.named_modules()), _Inputs(model), {}
    found, missed = [], []
    for parent, children in sorted(regions.items()):
        module = modules[parent]
        if parent in named or parent in by_fqn and not by_fqn[parent].style.own_forward:
            continue  # a Local (or a style built on it) runs its own forward on local shards
        inner = sorted(r for r in regions if r != parent and (not parent or r.startswith(parent + ".")))
        if inner:  # its run would enter them without the boundaries of their own entries (PrepareInput...)
            missed.append((parent, f"it holds other planned regions ({inner[0]}, ...), audited each on its own; its "
                           f"own ops around {[c.rpartition('.')[2] for c in children]} are not"))
            continue
        try:
            shapes, attrs, opaque = _local_view(parent, module, by_fqn, specs, mesh)
            for name, per_axis in (rules or {}).items():
                if not parent or name.startswith(parent + "."):
                    rel = name[len(parent) + 1:] if parent else name
                    full = module.get_parameter(rel).shape
                    shapes[rel] = local_layout(full, mesh_placements(per_axis, mesh, name), mesh, name)[0]
        except PlanError:  # indivisible dims, bad placements: placing the parameters raises those itself
            continue
        call = inputs.of(parent, module, _input_shape(module))
        if call is None:
            missed.append((parent, "its arguments cannot be synthesized (not reached by a meta forward of the model "
                           f"from input_ids{': ' + inputs.why if inputs.why else ''}, and its forward takes more "
                           "than one tensor)"))
            continue
        key = (type(module), tuple((n, tuple(t.shape)) for n, t in module.named_parameters()),
               tuple(sorted(shapes.items())), tuple(sorted(attrs.items())), _ints(module), _shapes(call),
               tuple(sorted((k, repr(v)) for k, v in opaque.items())))
        if key not in seen:
            seen[key] = _AUDITS.get((key, fingerprint(module), mesh.size()), lambda a=(module, call, shapes, attrs, opaque):
                                    _audit(*a, mesh.size()))
        result = seen[key]
        if isinstance(result, str):
            missed.append((parent, result))
        elif result is not None:
            found.append((parent, *_message(parent, module, children, attrs, *result)))
    return found, missed


def _audit(module, call, shapes, attrs, opaque, n):
    """None: exact; a str: why it was not audited; else (the mismatch, the local ops)."""
    outputs: dict = {}
    ref, ok = record(module, *call, opaque=dict.fromkeys(opaque), outputs=outputs)
    if not ok:
        return "its forward fails at global shapes on meta tensors"
    ops, _ = record(module, *call, shapes=shapes, attrs=attrs, opaque=opaque,
                    outputs={k: list(v) for k, v in outputs.items()})
    bad = compare(ref, ops, n)
    local_args = per_head_arguments(*call, head_counts(module), n) if bad is not None else None
    if local_args is not None:  # per-head arguments from an earlier layer arrive with this rank's heads
        again, _ = record(module, *local_args, shapes=shapes, attrs=attrs, opaque=opaque,
                          outputs={k: list(v) for k, v in outputs.items()})
        if compare(ref, again, n) is None:
            return None
    if bad is not None and bad.rule == "raises" and bad.glob.name == "__deepcopy__":  # the audit's own copy failed
        return "its modules cannot be copied at local shapes (a tensor subclass without clone)"
    if bad is not None and bad.rule == "count":  # control flow on a localised attribute (repeat_kv's n_rep == 1)
        return f"its forward takes another path at local shapes ({bad.why}); the two runs cannot be compared op by op"
    return None if bad is None else (bad, ops)


def _message(parent: str, module: nn.Module, children: list[str], attrs: Mapping[str, int], bad: Mismatch,
             ops) -> tuple[str, str]:
    """(code, message) naming the region, the op and the attributes to localise."""
    tags, earlier = culprits(ops, bad.index)
    names = sorted(tags)
    heads = [(o, a) for o, a in names if "head" in a and "dim" not in a and "size" not in a]
    named = heads or names

    def value(owner, attr):
        return getattr(module.get_submodule(owner) if owner else module, attr)

    def listed(pairs):
        return ", ".join(f"attribute {(o + '.') if o else ''}{a}={value(o, a)}" for o, a in pairs)

    kept = [(o, a) for o, a in named if (f"{o}.{a}" if o else a) not in attrs]
    cut = [(o, a) for o, a in named if (f"{o}.{a}" if o else a) in attrs]
    where = (f"{parent or '<root module>'}: op {bad.glob.name} (in the forward around its planned projections "
             f"{[c.rpartition('.')[2] for c in children]}): {bad.why}")
    if bad.rule == "packed":  # a projection's packing, not a head count: the why names the fix
        return "shape", where
    below = [(c.rpartition(".")[2], module.get_submodule(c[len(parent) + 1:] if parent else c)) for c in children]
    convs = [name for name, m in below if isinstance(m, CONVS)]
    if convs:  # channels split on dim 1, not heads: name the per-channel styles
        return "shape", (f"{where}; the channels of {convs} are split on dim 1, so every module that reads them must "
                         "be planned per channel: a convolution Rowwise() (or Colwise(input_layout=Shard(1))), a "
                         "BatchNorm, GroupNorm or grouped convolution Channels() — or gather them first "
                         "(Colwise(gather_output=True))")
    if earlier is not None:
        return "shape", (f"{where}; no integer attribute fed it (the nearest op before it that took one, "
                         f"{earlier.name}, took {listed(names)}): divide the head counts it uses "
                         f"(Heads(attrs=...) on {parent!r}), leave per-head sizes whole, or gather the projections "
                         "(Colwise(gather_output=True)) — fewer KV heads than ranks in a fused projection cannot split")
    if kept:
        owners = sorted({o for o, _ in kept})
        target = ".".join(x for x in (parent, owners[0]) if x)
        fix = f"Heads(attrs={tuple(a for o, a in kept if o == owners[0])!r})"
        return "head-attr", (f"{where}; it was given {listed(kept)}, which the skeleton keeps at its global value; "
                             f"plan {target!r} as {fix} so that the skeleton holds the local count (or "
                             "PrepareInput(..., divide_attrs=...))")
    if cut:
        return "head-attr", (f"{where}; it was given {listed(cut)}, which the plan divides on the skeleton: leave it "
                             "out of Heads(attrs=...) / divide_attrs")
    return "shape", (f"{where}; no integer attribute fed it: plan alike the projections it combines (one left "
                     f"replicated beside a sharded sibling?), divide the head counts of {parent!r} (Heads(attrs=...)), "
                     "or gather its projections (Colwise(gather_output=True))")


def _ints(module: nn.Module) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((n, v) for n, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)))


def _shapes(obj):
    if isinstance(obj, torch.Tensor):
        return tuple(obj.shape), obj.dtype
    if isinstance(obj, (tuple, list)):
        return tuple(_shapes(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _shapes(v)) for k, v in obj.items())
    return type(obj).__name__


def _local_view(parent: str, module: nn.Module, by_fqn: Mapping[str, Planned], specs: Mapping[str, ModuleSpec],
                mesh: DeviceMesh) -> tuple[dict[str, torch.Size], dict[str, int], dict]:
    """(local shapes by parameter path below ``parent``, skeleton attributes by path, the planned
    projections below it with their ``Handoff``) as the skeleton would hold them."""
    shapes, attrs, opaque = {}, {}, {}
    params = dict(module.named_parameters())
    for fqn, p in by_fqn.items():
        if fqn != parent and not fqn.startswith(f"{parent}." if parent else ""):
            continue
        rel = fqn[len(parent) + 1:] if parent and fqn != parent else ("" if fqn == parent else fqn)
        prefix = f"{rel}." if rel else ""
        spec = specs[fqn]
        for name, per_axis in spec.params.items():
            full = params.get(prefix + name)
            dst = spec.param_dst.get(name, {})  # gathered whole before the forward (ShardedParams): seen whole
            used = {a: Replicate() if isinstance(dst.get(a), Replicate) else pl for a, pl in per_axis.items()}
            if full is not None:
                shapes[prefix + name] = local_layout(full.shape, mesh_placements(used, mesh, fqn), mesh, fqn)[0]
        size = mesh.size(list(mesh.mesh_dim_names).index(p.axis))
        sub = module.get_submodule(rel) if rel else module
        # a buffer its local forward reads otherwise than stored (Channels: a BatchNorm's slice of its statistics)
        shapes.update({prefix + n: shape for n, shape in p.style.local_buffer_shapes(sub, size).items()})
        for attr in spec.divide_attrs:
            value = getattr(sub, attr, None)
            if not isinstance(value, int) or value % size:
                raise PlanError(f"{fqn}: {attr}")  # check_head_counts names it; nothing to run
            attrs[prefix + attr] = value // size
        for attr, value in spec.set_attrs.items():
            attrs[prefix + attr] = value
        if rel and boundaries(spec, p.axis):
            opaque[rel] = handoff(spec, p.axis, size)  # every planned module below: its boundaries applied
    return shapes, attrs, opaque
