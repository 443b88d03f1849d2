"""The lowering table's Steps carry their collective (the entry of ``core.collectives``' table),
the dataflow pass reads what a step hands on from it, and no code names a collective by a
string outside the table.  Nothing communicates: steps are built, not run."""

import ast
from pathlib import Path

from torch.distributed.tensor import Partial, Replicate, Shard

from hp_functional import collectives as C
from hp_functional.compile.dataflow import _invariant_after, _split_after
from hp_functional.core.lowering import lower
from hp_functional.core.placement import GroupedShard

G = C.AxisGroup("tp", "g", 2, 0)
R, P = Replicate(), Partial()

# (src, dst, consumer_varying, src_varying) -> the entry lower() applies: every row of its table
ROWS = [
    ((R, R, True, False), C.CopyTo),
    ((R, R, False, True), C.LeaveRegion),
    ((Shard(1), R, False, False), C.GatherFrom),
    ((Shard(1), R, True, False), C.AllGather),
    ((P, R, False, False), C.ReduceFrom),
    ((P, R, True, False), C.AllReduce),
    ((P, Shard(0), False, False), C.ReduceScatter),
    ((Shard(0), Shard(1), True, False), C.AllToAll),
    ((R, Shard(0), False, False), C.SplitTo),
    ((R, P, False, False), C.PartialFrom),
    ((GroupedShard(0, 2), Shard(0), True, False), C.CopyToReplicas),
]


def _step(src, dst, consumer, src_varying):
    return lower(src, dst, G, consumer_varying=consumer, src_varying=src_varying, where="m")


def test_steps_carry_their_collective():
    """Each lowered Step holds the table's entry itself (compared by identity) and its destination."""
    for (src, dst, consumer, src_varying), entry in ROWS:
        step = _step(src, dst, consumer, src_varying)
        assert step.collective is entry, (src, dst, consumer, step.collective.name)
        assert step.collective is C.COLLECTIVES[entry.name] and step.dst == dst and step.axis == "tp"
    assert _step(R, R, False, False) is None and _step(R, R, True, True) is None


def test_what_a_step_hands_on_comes_from_its_collective():
    """The dataflow pass: invariant after a V→I collective (reduced, gathered, leaving a region),
    split after one that places Shard or Partial; a Replicate handed to rank-varying compute
    (copy_to, all_gather, all_reduce) keeps the axes it had."""
    invariant = {entry for (src, dst, c, v), entry in ROWS if _invariant_after([_step(src, dst, c, v)])}
    split = {entry for (src, dst, c, v), entry in ROWS if _split_after([_step(src, dst, c, v)])}
    assert invariant == {C.ReduceFrom, C.GatherFrom, C.LeaveRegion}
    assert split == {C.SplitTo, C.PartialFrom, C.AllToAll, C.ReduceScatter, C.CopyToReplicas}
    assert {c.name for c in C.COLLECTIVES.values() if c.makes_invariant} == {
        "reduce_from", "gather_from", "leave_region", "reduce_from_replicas"}
    assert all(c.makes_invariant == (c.types.dst is C.ValueType.INVARIANT) for c in C.COLLECTIVES.values())


#: literals equal to a collective's name allowed outside core/collectives.py: the names of the raw
#: communications (torch's c10d ops) in text for people — error labels, schedule rows, what a Step
#: communicates — never a collective of the table named by a string
RAW = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "ppermute"}
ALLOWED = {
    "hp_functional/core/raw_collectives.py": RAW,  # wait()'s labels in timeout errors
    "hp_functional/core/lowering.py": {"all_reduce"},  # Step.forward/backward: what it communicates
    "hp_functional/tools/record.py": {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"},  # ScheduleRow.op
    "hp_functional/tools/explain.py": {"all_reduce"},  # a bucket's backward, matched against ScheduleRow.op
    "hp_functional/train/data_parallel.py": {"all_reduce"},  # wait()'s label
    "hp_functional/train/fsdp.py": {"all_gather", "reduce_scatter"},  # collectives_per_step()'s keys
}


def test_no_collective_named_by_a_string_outside_the_table():
    """Code compares ``step.collective is C.CopyTo`` (or reads its ``types``), never a name: a
    string literal equal to a collective's name (docstrings aside) outside core/collectives.py is
    an error unless ``ALLOWED`` lists it for that file."""
    root = Path(__file__).resolve().parents[2]
    names = set(C.COLLECTIVES)
    found = []
    for path in sorted((root / "hp_functional").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "hp_functional/core/collectives.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                    and id(node) not in docs and node.value not in ALLOWED.get(rel, ())):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "collectives named by a string (use the table's entry, e.g. C.CopyTo):\n" + "\n".join(found)
    assert all(RAW >= v for v in ALLOWED.values())  # only raw communications' names, never a table-only one
