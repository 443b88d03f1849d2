"""Property-based tests (hypothesis): random models, meshes and plans, run inside the rank pool.

* any valid plan (MLP / gated / packed MLP / attention blocks, optional embedding, norms and head,
  replicated or sequence-parallel, acting on either axis of a 1-D or 2-D mesh) gives the
  unsharded model's output and every gradient, and mutates nothing;
* any invalid plan (one fault injected into a valid one) raises the documented error naming the
  culprit, on every rank, with the model untouched.

Cases are drawn in the test process and each runs on every rank with one ``pool.run``.
"""

from __future__ import annotations

import fnmatch
import os
import pickle
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from torch.distributed.tensor import Replicate, Shard

import hp_functional as hpf
from hp_functional.core.style import ModuleSpec, Style
from hp_functional.sources.hf import HF_STYLES
from tests.support import property_cases as pc
from tests.support.property_cases import BlockSpec, Case, MixSpec, NetSpec

MESHES = {
    2: [((2,), ("tp",)), ((2,), ("model",)), ((1, 2), ("dp", "tp")), ((2, 1), ("dp", "tp"))],
    4: [((4,), ("tp",)), ((4,), ("model",)), ((2, 2), ("dp", "tp"))],
}
HF_NAMES = [(style, name) for name, style in HF_STYLES.items()]
EXAMPLES = int(os.environ.get("HPF_PROPERTY_EXAMPLES", "60"))  # per test and world size (more on demand)


def _settings(examples: int):
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def matches(pattern: str, path: str) -> bool:
    """The plan language's matching, written independently of ``core.paths``: a segment is matched
    by ``fnmatch`` within itself (``*`` is exactly one segment, ``mi*x`` matches ``mix``), ``**`` is
    any number of segments, "" is the root only."""
    if not pattern or not path:
        return pattern == path
    p, q = pattern.split("."), path.split(".")

    def rest(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(q)
        if p[i] == "**":
            return any(rest(i + 1, k) for k in range(j, len(q) + 1))
        return j < len(q) and fnmatch.fnmatchcase(q[j], p[i]) and rest(i + 1, j + 1)

    return rest(0, 0)


# ------------------------------------------------------------------------------- valid cases
@st.composite
def mix_specs(draw, mix_kind: str, kind: str, n: int) -> MixSpec:
    dims = pc.sharded_dims(kind, MixSpec(mix_kind))
    common = dict(bias=draw(st.booleans()), act=draw(st.sampled_from(sorted(pc.ACTS))))
    if mix_kind != "attn":
        hidden = n * draw(st.integers(1, 3)) if dims == "hidden" else draw(st.integers(1, 7))
        return MixSpec(mix_kind, hidden=hidden, **common)
    if dims == "heads":
        k = draw(st.integers(1, 2))
        heads, kv = n * k, n * draw(st.sampled_from([j for j in (1, 2) if k % j == 0]))
        hd = draw(st.integers(1, 3))
    else:
        heads = draw(st.integers(1, 4))
        kv = draw(st.sampled_from([j for j in range(1, heads + 1) if heads % j == 0]))
        hd = n * draw(st.integers(1, 2)) if dims == "features" else draw(st.integers(1, 3))
    return MixSpec("attn", heads=heads, kv_heads=kv, head_dim=hd, causal=draw(st.booleans()), **common)


@st.composite
def valid_cases(draw, world: int, split: bool = False, heads: bool = False) -> Case:
    """A model, a mesh and a valid plan over one of its axes, tracking the activation layout
    (R replicated, S sequence-sharded) from the input to the output.  ``split``: the axis has
    size > 1; ``heads``: every block is attention with divided head counts (for fault injection)."""
    shape, names = draw(st.sampled_from(MESHES[world]))
    axis = draw(st.sampled_from([a for a, size in zip(names, shape, strict=True) if size > 1 or not split]))
    n = shape[names.index(axis)]
    d = draw(st.integers(2, 8))
    top: dict[str, Style] = {}
    emb_kind, vocab, pad = draw(st.sampled_from(["absent", "none", "vocab", "vocab_seq"])), 0, None
    if emb_kind != "absent":
        vocab = n * draw(st.integers(1, 4)) if emb_kind != "none" else draw(st.integers(2, 9))
        pad = draw(st.none() | st.integers(0, vocab - 1))
        state, in_layout = ("S" if emb_kind == "vocab_seq" else "R"), "R"
        if emb_kind != "none":
            top["emb"] = hpf.VocabEmbedding(output_layout=Shard(1) if state == "S" else Replicate())
    else:
        state = in_layout = draw(st.sampled_from("RS"))
    uses_seq = state == "S"
    blocks, layers, kinds = [], [], []
    for _ in range(draw(st.integers(1, 2))):
        styles: dict[str, Style] = {}
        if state == "R" and draw(st.integers(0, 3)) == 0:  # split the sequence at this block's input
            styles[""] = hpf.PrepareInput({draw(st.sampled_from([0, "h"])): (Replicate(), Shard(1))})
            state, uses_seq = "S", True
        norm = draw(st.sampled_from([None, "layer", "layer_nobias", "rms"]))
        mix_kind = "attn" if heads else draw(st.sampled_from(["mlp", "gated", "packed", "attn"]))
        if state == "R":
            if norm and draw(st.booleans()):
                styles["norm"] = hpf.NoParallel()
            options = list(pc.R_KINDS)
        else:
            gathered = norm is not None and draw(st.booleans())
            if norm:
                styles["norm"] = hpf.SequenceParallel(output_layout=Replicate() if gathered else None)
            options = pc.S_GATHERED_KINDS if gathered else [k for k in pc.S_KINDS if not (k == "sp" and mix_kind == "attn")]
        kind = draw(st.sampled_from([k for k in options if k in pc.HEAD_DIV or not heads]))
        mix = draw(mix_specs(mix_kind, kind, n))
        mixer = pc.mix_styles(kind, mix, axis, draw(st.sampled_from([0, "x"])), draw(st.booleans()))
        styles.update({"mix" + (f".{rel}" if rel else ""): s for rel, s in mixer.items()})
        blocks.append(BlockSpec(norm, mix, draw(st.booleans())))
        layers.append(styles)
        kinds.append(kind)
    final = draw(st.sampled_from([None, "layer", "rms"]))
    if final and state == "S":
        gathered = draw(st.booleans())
        top["norm_f"] = hpf.SequenceParallel(output_layout=Replicate() if gathered else None)
        state = "R" if gathered else "S"
    elif final and draw(st.booleans()):
        top["norm_f"] = hpf.NoParallel()
    if state == "S":
        head_kind = draw(st.sampled_from(["absent", "sp_gather", "sp_vocab"]))
    else:
        head_kind = draw(st.sampled_from(["absent", "none", "gather", "vocab"] + (["rowwise"] if d % n == 0 else [])))
    colwise = head_kind in ("gather", "vocab", "sp_gather", "sp_vocab")
    head = 0 if head_kind == "absent" else n * draw(st.integers(1, 3)) if colwise else draw(st.integers(1, 6))
    seq_in = Shard(1) if state == "S" else Replicate()
    head_style = {"gather": hpf.Colwise(gather_output=True), "vocab": hpf.Colwise(),
                  "rowwise": hpf.Rowwise(input_layout=Replicate()),
                  "sp_gather": hpf.Colwise(input_layout=seq_in, gather_output=True), "sp_vocab": hpf.Colwise(input_layout=seq_in)}
    if head_kind in head_style:
        top["head"] = head_style[head_kind]
    out_layout = {"absent": state, "none": "R", "vocab": "V", "sp_vocab": "V"}.get(head_kind, "R")
    net = NetSpec(d, tuple(blocks), vocab, pad, final, head, draw(st.booleans()))

    explicit = draw(st.booleans())  # styles name their axis, vs the plan's tp_axis (HF strings allowed)

    def express(s: Style) -> Style | str:
        if isinstance(s, ModuleSpec):
            return s
        if explicit:
            return replace(s, axis=axis)
        hf = [name for style, name in HF_NAMES if style == s]
        return draw(st.sampled_from(hf)) if hf and draw(st.booleans()) else s

    paths = set(pc.module_types(net))
    entries = {p: express(s) for p, s in top.items()}
    for rel in sorted(set().union(*layers)):
        suffix, values = f".{rel}" if rel else "", [styles.get(rel) for styles in layers]
        if draw(st.booleans()):  # one wildcard entry, overridden by exact paths where a layer differs
            base = next(v for v in values if v is not None)
            entries[f"blocks.*{suffix}"] = express(base)
            for i, v in enumerate(values):
                if v != base and f"blocks.{i}{suffix}" in paths:
                    entries[f"blocks.{i}{suffix}"] = express(v if v is not None else hpf.NoParallel())
        else:
            entries.update({f"blocks.{i}{suffix}": express(v) for i, v in enumerate(values) if v is not None})
    entries = {k: entries[k] for k in draw(st.permutations(list(entries)))}
    seq = n * draw(st.integers(1, 3)) if uses_seq else draw(st.integers(1, 5))
    tp_axis = "tp" if explicit else axis
    return Case(shape, names, axis, net, entries, tp_axis, in_layout, out_layout,
                batch=draw(st.integers(1, 2)), seq=seq, seed=draw(st.integers(0, 2**16)), use_grad=draw(st.booleans()),
                meta={"kinds": tuple(kinds), "emb": emb_kind, "head": head_kind, "explicit": explicit})


# ----------------------------------------------------------------------------- invalid cases
BOGUS_AXES = ("ep", "pp", "cp")
BAD_HF = ("local_colwise", "grouped_gemm", "isolated", "gather", "ep_router")
FIRST_COL = {"packed": "gate_up", "gated": "gate", "mlp": "up", "attn": "q"}


def _fault_shape(draw, case: Case, n: int):
    """Make one sharded dim indivisible: the error names the first parameter in model order."""
    kinds, net = case.meta["kinds"], case.net
    options = [("emb", None)] if case.meta["emb"] in ("vocab", "vocab_seq") else []
    options += [("head", None)] if case.meta["head"] in ("gather", "vocab", "sp_gather", "sp_vocab") else []
    options += [("block", i) for i, (k, b) in enumerate(zip(kinds, net.blocks, strict=True))
                if pc.sharded_dims(k, b.mix) in ("hidden", "features")
                and not (b.mix.kind == "packed" and k == "gather" and n == 2)]  # 2 * hidden always divides by 2
    if not options:
        return None
    where, i = draw(st.sampled_from(options))
    odd = draw(st.sampled_from([1, 3, 5, 7]))
    exc, needles = "ShapeError", (f"'{case.axis}'",)
    if where == "emb":
        net, culprit = replace(net, vocab=odd, padding_idx=None), "emb.weight"
    elif where == "head":
        net, culprit = replace(net, head=odd), "head.weight"
    else:
        block = net.blocks[i]
        mix, row = block.mix, kinds[i] == "split_input"
        if mix.kind == "attn":
            mix = replace(mix, heads=odd, kv_heads=draw(st.sampled_from([1, odd])), head_dim=draw(st.sampled_from([1, 3])))
        else:
            mix = replace(mix, hidden=odd)
            packed = mix.kind == "packed" and kinds[i] in pc.HEAD_DIV  # Colwise(packed=2) in these kinds
            if packed and (2 * odd) % n == 0:  # the dim divides, its blocks do not
                exc, needles = "PlanError", ("packed blocks",)
        culprit = f"blocks.{i}.mix." + (("o" if mix.kind == "attn" else "down") if row else FIRST_COL[mix.kind]) + ".weight"
        net = replace(net, blocks=(*net.blocks[:i], replace(block, mix=mix), *net.blocks[i + 1 :]))
    return replace(case, net=net), exc, (f"parameter {culprit}:", *needles)


def _fault_heads(draw, case: Case, n: int):
    """A head count that does not divide the axis (or KV heads that neither divide nor are
    divided by its size: fewer KV heads that do divide it are replicated, ``compile.kv_heads``)."""
    options = [i for i, (k, b) in enumerate(zip(case.meta["kinds"], case.net.blocks, strict=True))
               if pc.sharded_dims(k, b.mix) == "heads"]
    if not options:
        return None
    i = draw(st.sampled_from(options))
    block = case.net.blocks[i]
    if draw(st.booleans()):
        heads = draw(st.sampled_from([1, 3, 5]))
        mix, needle = replace(block.mix, heads=heads, kv_heads=1), f"num_heads={heads}"
    else:
        mix, needle = replace(block.mix, heads=3 * n, kv_heads=3), "3 KV heads"
    net = replace(case.net, blocks=(*case.net.blocks[:i], replace(block, mix=mix), *case.net.blocks[i + 1 :]))
    return replace(case, net=net), "PlanError", (f"blocks.{i}.mix:", needle, f"'{case.axis}'")


def _styled(case: Case, style: Style) -> Style:
    return replace(style, axis=case.axis) if case.meta["explicit"] else style


def _insert(draw, entries: dict, pattern: str, value) -> dict:
    items = [(k, v) for k, v in entries.items() if k != pattern]
    at = draw(st.integers(0, len(items)))
    return dict([*items[:at], (pattern, value), *items[at:]])


@st.composite
def invalid_cases(draw, world: int):
    """(case, exception name, strings the message must contain, fault): a valid case with one fault."""
    fault = draw(st.sampled_from(["no_match", "wrong_type", "conflict", "hf_string", "axis", "shape", "heads"]))
    case = draw(valid_cases(world, split=fault in ("shape", "heads"), heads=fault == "heads"))
    n = case.mesh_shape[case.mesh_names.index(case.axis)]
    modules = pc.module_types(case.net)
    out = None
    if fault == "shape" and n > 1:
        out = _fault_shape(draw, case, n)
    elif fault == "heads" and n > 1:
        out = _fault_heads(draw, case, n)
    elif fault == "axis":
        named = [p for p, v in case.entries.items() if not isinstance(v, ModuleSpec)]  # styles and HF strings
        bogus, missing = draw(st.sampled_from(BOGUS_AXES)), "is not in the mesh"
        if named and case.meta["explicit"]:  # one style names an axis the mesh lacks
            p = draw(st.sampled_from(named))
            entries = {**case.entries, p: replace(case.entries[p], axis=bogus)}
            out = replace(case, entries=entries), "PlanError", (f"plan entry {p!r}", f"mesh axis {bogus!r} {missing}")
        elif named:  # the plan's tp_axis is not in the mesh: the first entry using it is named
            out = replace(case, tp_axis=bogus), "PlanError", (f"plan entry {named[0]!r}", f"mesh axis {bogus!r} {missing}")
    elif fault == "conflict":
        out = _fault_conflict(draw, case, modules)
    elif fault == "wrong_type":
        out = _fault_wrong_type(draw, case, modules)
    elif fault == "hf_string":
        p = draw(st.sampled_from(sorted(case.entries) or sorted(p for p in modules if p)))
        bad = draw(st.sampled_from(BAD_HF))
        out = replace(case, entries=_insert(draw, case.entries, p, bad)), "PlanError", (f"plan entry {p!r}", f"style {bad!r}")
    if out is None:  # fall back to a pattern that matches nothing: a typo, a missing index or module
        fault = "no_match"
        paths = [p for p in modules if p]
        p = draw(st.sampled_from(paths))
        mutated = draw(st.sampled_from([p + "x", p[:-1] + "*x", f"blocks.{len(case.net.blocks)}" + p[len("blocks.0"):]
                                        if p.startswith("blocks.") else "tail", "emb" if "emb" not in modules else "head_x"]))
        if any(matches(mutated, q) for q in modules):
            mutated = "nothing.here"
        entries = _insert(draw, case.entries, mutated, _styled(case, hpf.NoParallel()))
        out = replace(case, entries=entries), "PlanError", (f"plan entry {mutated!r} matches no module",)
    return (*out, fault)


WRONG = [  # (module types, style, the phrase the error must contain)
    (("Embedding", "LayerNorm", "RMSNorm", "Mlp", "Attn", "Block", "ModuleList"), hpf.Colwise(), "Colwise needs a Linear"),
    (("Embedding", "LayerNorm", "RMSNorm", "Mlp", "Attn", "Block", "ModuleList"), hpf.Rowwise(), "Rowwise needs a Linear"),
    (("Linear", "LayerNorm", "RMSNorm", "Mlp", "Attn", "Block"), hpf.VocabEmbedding(), "VocabEmbedding needs a Embedding"),
    (("Linear", "Embedding"), hpf.SequenceParallel(), "SequenceParallel needs a norm-like module"),
]


def _fault_wrong_type(draw, case: Case, modules: dict):
    """A style on a module type it cannot handle, on any module, planned or not (the style's own
    error comes before lint's view of the broken data flow)."""
    options = [(p, style, phrase) for p in modules if p for types, style, phrase in WRONG if modules[p] in types]
    p, style, phrase = draw(st.sampled_from(options))
    entries = _insert(draw, case.entries, p, _styled(case, style))
    return replace(case, entries=entries), "PlanError", (f"{p}: {phrase}",)


def _fault_conflict(draw, case: Case, modules: dict):
    """Two equally specific patterns, each matching only one module, with different styles."""
    by_target = {}
    for t in (p for p in modules if p.count(".") >= 1):
        segs = t.split(".")
        pats = [".".join("*" if (mask >> j) & 1 else s for j, s in enumerate(segs)) for mask in range(1, 2 ** len(segs) - 1)]
        unique = [q for q in pats if [m for m in modules if matches(q, m)] == [t]]
        groups = {}
        for q in unique:
            groups.setdefault(q.count("*"), []).append(q)
        by_target[t] = [g for g in groups.values() if len(g) >= 2]
    targets = sorted(t for t, g in by_target.items() if g)
    if not targets:
        return None
    t = draw(st.sampled_from(targets))
    p1, p2 = draw(st.lists(st.sampled_from(draw(st.sampled_from(by_target[t]))), min_size=2, max_size=2, unique=True))
    pool = [hpf.Colwise(), hpf.Rowwise(), hpf.Colwise(gather_output=True), hpf.NoParallel(), hpf.SequenceParallel()]
    s1, s2 = draw(st.lists(st.sampled_from(pool), min_size=2, max_size=2, unique_by=repr))
    entries = {k: v for k, v in case.entries.items() if not matches(k, t)}
    entries = _insert(draw, _insert(draw, entries, p1, _styled(case, s1)), p2, _styled(case, s2))
    return replace(case, entries=entries), "PlanError", (f"{t}: conflicting plan entries", repr(p1), repr(p2))


# ------------------------------------------------------------------------------------- tests
def _run(pool, fn, case: Case, *args) -> list:
    """One case on every rank; pickled here first so a bad argument fails now, not at the timeout."""
    args = (case, *args)
    pickle.dumps(args)
    return pool.run(fn, *args, timeout=60)


@_settings(EXAMPLES)
@given(data=st.data())
@pytest.mark.slow
def test_valid_plans_match_unsharded(pool, data):
    case = data.draw(valid_cases(pool.world), label="case")
    event(f"mesh {case.mesh_shape} on {case.axis!r}, {'styles name the axis' if case.meta['explicit'] else 'tp_axis'}")
    event(f"layout {case.in_layout} -> {case.out_layout}, {'torch.func.grad' if case.use_grad else 'backward()'}")
    for block, kind in zip(case.net.blocks, case.meta["kinds"], strict=True):
        event(f"block {block.mix.kind} {kind}")
    _run(pool, pc.run_valid, case)


@_settings(2 * EXAMPLES)  # cheap: shard() raises before any communication
@given(data=st.data())
@pytest.mark.slow
def test_invalid_plans_raise_naming_the_culprit(pool, data):
    case, exc, needles, fault = data.draw(invalid_cases(pool.world), label="invalid case")
    event(f"fault {fault} -> {exc}")
    messages = _run(pool, pc.run_invalid, case, exc, needles)
    assert len(set(messages)) == 1, messages  # the same error on every rank
