"""``hpf.generate(apply_fn, params, ...)``: Hugging Face's ``generate()`` on the sharded model.

The loop is transformers' own (greedy, sampling, beam search, stopping, the KV cache, left
padding): it runs on ``apply_fn``'s private skeleton, in eval mode for the call, with ``params``
bound once (``ApplyFn.bound``), so a decoding step costs the forward and the collectives its boundaries
issue, nothing per parameter.  The inputs are agreed once, values included, before the first
forward; each step's inputs then follow from them and from logits that are alike on every rank.
See docs/generation.md.
"""

from __future__ import annotations

__all__ = ["generate"]

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from ..core.errors import PlanError
from ..core.placement import splits
from ..core.program import Program
from ..runtime.apply_fn import ApplyFn
from ..runtime.rng import active_rng

_FIX = ("shard the model again with a plan without it (hpf.shard(model, plan, mesh)), move the params there with "
        "hpf.reshard(params, shard_info, new_shard_info), and generate with that apply_fn")


def generate(apply_fn: ApplyFn, params: Mapping[str, Tensor], *args, **kwargs):
    """``model.generate(*args, **kwargs)`` of the unsharded model in eval mode, computed at
    ``apply_fn``'s layout: the same tokens (greedy, beam search; sampled ones too under
    ``hpf.rng(seed)``, whatever the layout), the KV cache holding each rank's heads.

    Call it on every rank of the mesh with the same arguments (the ranks of a data-parallel or
    ``hpf.fsdp`` axis may pass their own prompts).  Under ``hpf.fsdp`` every group is gathered
    once (one all-gather per group) before the first token, never per token.  Refused by name
    (``PlanError``, on every rank, before any collective): a layout that splits the sequence over
    ranks (context parallelism), logits left sharded over the vocabulary (``loss_parallel``),
    sampling on more than one rank without ``hpf.rng`` (ranks would draw different tokens), experts
    fed each rank's own tokens without ``synced_gpus=True``, a model without ``generate``.

    Args:
        apply_fn, params: from ``hpf.shard`` (or ``hpf.fsdp`` over it).
        *args, **kwargs: what ``model.generate`` takes (``input_ids``, ``attention_mask``,
            ``max_new_tokens``, ``do_sample``, ``num_beams``, a ``generation_config``, ...).
    Returns:
        What ``model.generate`` returns (the token ids, or its output object).
    """
    runtime = _runtime(apply_fn)
    program: Program = runtime.program
    skeleton = runtime.template
    config = _generation_config(skeleton, kwargs)
    _check_layout(skeleton, program, kwargs)
    if config.do_sample and active_rng() is None and _agreeing(apply_fn) and program.mesh.size() > 1:
        raise PlanError("generate: do_sample=True on several ranks draws each token from each rank's own torch "
                        "generator, so the ranks could pick different tokens and compute on a mix of them; "
                        "sample inside `with hpf.rng(seed):` (the same draws on every rank and at every layout)")
    if apply_fn.fsdp is not None:  # a skeleton whose parameters arrive converted: gathered once, below
        leaves = _fsdp_leaves(apply_fn, params)
        decoder = runtime.build(dataclasses.replace(program, param_steps={}, param_buckets=()))
    else:  # apply_fn's own skeleton, bound once for the call (nothing is built per call)
        leaves, decoder = _checked(program, params), apply_fn
    agreement = decoder.input_check
    if agreement is not None:  # once, values included: every later step follows from these and alike logits
        agreement.check(args, {k: _described(v) for k, v in kwargs.items()}, values=True)
    if apply_fn.fsdp is not None:
        leaves = _gathered(apply_fn, leaves)
    with torch.no_grad(), decoder.bound(leaves) as model, _eval(model):
        return model.generate(*args, **kwargs)


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    """``model`` (the private skeleton) in eval mode for the block; each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _runtime(apply_fn):
    runtime = getattr(apply_fn, "runtime", None)
    if not isinstance(apply_fn, ApplyFn) or runtime is None:
        raise PlanError("generate: apply_fn is not one that hpf.shard() (or hpf.fsdp()) returned (it has no .runtime)")
    if not callable(getattr(runtime.template, "generate", None)):
        raise PlanError(f"generate: {type(runtime.template).__name__} has no generate() (not a Hugging Face model with "
                        "transformers' GenerationMixin); write the decoding loop over apply_fn")
    return runtime


def _generation_config(skeleton: nn.Module, kwargs: Mapping):
    """The generation config ``generate`` will use: the model's (or the one passed), updated by the kwargs."""
    config = copy.deepcopy(kwargs.get("generation_config") or skeleton.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _agreeing(apply_fn: ApplyFn) -> bool:
    """Whether some mesh axis must see the same inputs (the ranks that must pick the same tokens)."""
    return apply_fn.input_check is not None and bool(apply_fn.input_check.axes)


def _check_layout(skeleton: nn.Module, program: Program, kwargs: Mapping) -> None:
    """A ``PlanError`` for a layout that cannot decode token by token (see ``generate``)."""
    for b in program.boundaries:
        if b.spec.data_axes:
            raise PlanError(f"generate: {b.planned.fqn or '<root module>'} splits the sequence over mesh axis "
                            f"{b.spec.data_axes[0]!r} (context parallelism), which cannot decode one token at a time; "
                            + _FIX)
        if b.spec.summed_axes and not kwargs.get("synced_gpus"):
            raise PlanError(f"generate: {b.planned.fqn} takes each rank's own tokens over mesh axis {b.spec.summed_axes[0]!r}, "
                            "so every rank of it must run as many forwards as the others: pass synced_gpus=True")
    head = skeleton.get_output_embeddings() if hasattr(skeleton, "get_output_embeddings") else None
    path = next((p for p, m in skeleton.named_modules() if m is head), None) if head is not None else None
    boundary = next((b for b in program.boundaries if b.planned.fqn == path), None) if path is not None else None
    out = boundary.spec.out_dst.get("output", {}) if boundary is not None else {}
    sharded = next((a for a, p in out.items() if splits(p)), None)
    if sharded is not None:
        raise PlanError(f"generate: the output head {path} keeps its logits sharded over mesh axis {sharded!r} "
                        "(loss_parallel), so no rank sees every token's score; " + _FIX)


def _checked(program: Program, params: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``params`` if it holds this rank's local shards of every leaf, else a PlanError naming one."""
    infos = program.infos
    if not isinstance(params, Mapping) or params.keys() != infos.keys():
        theirs = set(params) if isinstance(params, Mapping) else set()
        raise PlanError(f"generate: params keys differ from shard()'s: missing {sorted(set(infos) - theirs)[:5]}, "
                        f"extra {sorted(theirs - set(infos))[:5]}")
    for k, info in infos.items():
        v = params[k]
        if not isinstance(v, Tensor) or tuple(v.shape) != tuple(info.local_shape):
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise PlanError(f"generate: params[{k!r}] has shape {got}, expected local {tuple(info.local_shape)}: pass "
                            "the params that hpf.shard() returned")
    return params


def _described(value):
    """A generation config by its fields (so the agreement compares them), anything else as it is."""
    to_dict = getattr(value, "to_diff_dict", None)
    return to_dict() if callable(to_dict) and not isinstance(value, (Tensor, nn.Module)) else value


def _fsdp_leaves(apply_fn: ApplyFn, params: Mapping[str, Tensor]) -> list[list[Tensor]]:
    """``params`` (an ``hpf.fsdp`` apply_fn's rows) checked and laid out by bucket, before any collective."""
    infos = apply_fn.program.infos
    if not isinstance(params, Mapping) or params.keys() != infos.keys():
        theirs = set(params) if isinstance(params, Mapping) else set()
        raise PlanError(f"generate: params keys differ from hpf.fsdp()'s: missing {sorted(set(infos) - theirs)[:5]}, "
                        f"extra {sorted(theirs - set(infos))[:5]}")
    out = []
    for bucket in apply_fn.fsdp.buckets:
        values = [params[k] for k in bucket.keys]
        for piece, v in zip(bucket.pieces, values, strict=True):
            if not isinstance(v, Tensor) or v.shape[1:] != piece.shape[1:] or v.dim() != len(piece.shape) \
                    or v.shape[0] > piece.chunk:
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise PlanError(f"generate: params[{piece.key!r}] is {got}, not this rank's rows of "
                                f"{tuple(piece.shape)} (at most {piece.chunk}): pass the params hpf.fsdp() returned")
        out.append(values)
    return out


def _gathered(apply_fn: ApplyFn, leaves: list[list[Tensor]]) -> dict[str, Tensor]:
    """The shard()-layout parameters, conversions applied: one all-gather per ``hpf.fsdp`` group."""
    full: dict[str, Tensor] = {}
    with torch.no_grad():
        for bucket, values in zip(apply_fn.fsdp.buckets, leaves, strict=True):
            full.update(zip(bucket.keys, bucket.gather(values), strict=True))
    return {k: full[k] for k in apply_fn.program.infos}
