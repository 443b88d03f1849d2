"""The seeded-mutation list stays true to the code: every mutation still applies to the function it
names (a refactor that moves its target fails here, not silently in `make mutation-check`), names
are unique, every named test file exists, and the list covers what docs/testing.md says it does."""

from tests.mutation_check import ROOT, StaleMutation, mutated_source
from tests.mutations import MUTATIONS


def test_every_mutation_still_applies():
    stale = []
    for m in MUTATIONS:
        try:
            mutated = mutated_source(m, (ROOT / m.path).read_text())
        except StaleMutation as exc:
            stale.append(str(exc))
            continue
        assert mutated != (ROOT / m.path).read_text(), f"{m.name} changes nothing"
        compile(mutated, m.path, "exec")  # a mutation is a bug in the code, not a syntax error
    assert not stale, "\n".join(stale)


def test_the_list_is_large_unique_and_covers_the_guarantees():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)) >= 30
    covered = {m.path for m in MUTATIONS}
    for module in ("core/collectives.py", "core/buckets.py", "train/fsdp.py", "parallel/context/styles.py",
                   "parallel/experts/styles.py", "runtime/probe.py", "compile/agree.py", "runtime/inputs.py",
                   "train/ckpt_integrity.py", "train/dcp_planners.py", "train/export.py", "runtime/weights.py",
                   "runtime/buffers.py", "runtime/remat.py", "train/optim.py", "train/clip.py"):
        assert f"hp_functional/{module}" in covered, f"no mutation of {module}"
    assert all(m.guards and m.tests for m in MUTATIONS)
    assert sum(m.core for m in MUTATIONS) >= 15
