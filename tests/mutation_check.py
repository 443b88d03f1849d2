"""Seeded-mutation check: does the suite catch what it claims?  (`make mutation-check`)

Each mutation of ``tests/mutations.py`` is a small patch to one named function (replace this text
with that, inside ``path::Qualified.name`` only).  For each, in a scratch copy of the repository
(the working tree is never touched), the patch is applied alone and the tests that cover the
function are run; a failing (or hanging) test *kills* the mutation, a passing run means it
*survived*: a bug of that shape would land unnoticed.  A mutation whose function or text is no
longer found is *stale* and fails the check loudly (fix the entry when the code moves), so the
list survives refactors instead of silently testing nothing.

Mutations of a core invariant (``core=True``) run their tests with ``-m "not slow"``: they must be
killed by ``make test-fast`` as well.  The run prints one line per mutation and ends with
``mutations: K killed, S survived (of N)``; it exits non-zero if any survived or is stale.

    python -m tests.mutation_check                 # every mutation
    python -m tests.mutation_check --only fsdp     # those whose name contains "fsdp"
    python -m tests.mutation_check --list          # the list, nothing run
    python -m tests.mutation_check --check         # every mutation still applies (fast; in the suite)

Why not a mutation-testing library: mutmut and cosmic-ray generate thousands of operator-level
mutants per module and rerun whole test selections for each (hours here, on 2 cores, with
multi-rank tests); what this project needs is the opposite — a short, reviewed list of the bugs
that matter (a transpose, a scale, a skipped check), each tied to the guarantee it breaks.
"""

from __future__ import annotations

import argparse
import ast
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("hp_functional", "tests", "docs", "examples", "benchmarks", "pyproject.toml", "README.md")


class StaleMutation(Exception):
    """A mutation whose target function or text is gone: the list must be updated."""


def _defines(node: ast.AST, name: str) -> bool:
    """Whether ``node`` defines ``name``: a function, a class, or an assignment to it (a table entry
    such as ``CopyTo = _collective(...)``)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return False


def _function_span(source: str, qualname: str, path: str) -> tuple[int, int]:
    """(first, last) line (1-based, inclusive) of the function, class or assigned name ``qualname`` in ``source``."""
    nodes = [ast.parse(source)]
    for part in qualname.split("."):
        found = None
        for parent in nodes:
            for node in ast.walk(parent):
                if _defines(node, part):
                    found = node
                    break
            if found is not None:
                break
        if found is None:
            raise StaleMutation(f"{path}: no function or class {qualname!r} (missing {part!r})")
        nodes = [found]
    node = nodes[0]
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return first, node.end_lineno


def mutated_source(m: Mutation, source: str) -> str:
    """``source`` with ``m`` applied inside its function; StaleMutation if the text is not there
    exactly once."""
    missing = [t for t in m.tests if not (ROOT / t.split("::")[0]).exists()]
    if missing:
        raise StaleMutation(f"{m.name}: its tests {missing} do not exist")
    first, last = _function_span(source, m.function, m.path)
    lines = source.splitlines(keepends=True)
    body = "".join(lines[first - 1:last])
    count = body.count(m.find)
    if count != 1:
        raise StaleMutation(f"{m.target}: the text to replace occurs {count} times in the function, "
                            f"not once: {m.find!r}")
    return "".join(lines[:first - 1]) + body.replace(m.find, m.replace) + "".join(lines[last:])


def _scratch() -> Path:
    where = Path(tempfile.mkdtemp(prefix="hpf-mutation-"))
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, where / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, where / name)
    return where


def _run_tests(scratch: Path, tests: tuple[str, ...], fast: bool, timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'timeout' | 'error', the failing tests or the output's tail)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    if fast:
        cmd += ["-m", "not slow"]
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout:.0f} s"
    out = done.stdout + done.stderr
    if done.returncode == 0:
        return "passed", ""
    if done.returncode in (4, 5):  # a usage error, or nothing collected: the entry is wrong, not the code
        return "error", out.strip().splitlines()[-1] if out.strip() else f"pytest exited {done.returncode}"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
    return "failed", ", ".join(dict.fromkeys(failed)) or out.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every mutation still applies (none stale), running nothing")
    parser.add_argument("--baseline", action="store_true",
                        help="first run every mutation's tests unmutated (they must pass)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per mutation before it counts as killed")
    parser.add_argument("--jobs", type=int, default=2,
                        help="mutations run at once, each in a scratch copy of its own (default 2: the start-up of "
                             "pytest and the rank pools is mostly waiting)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.target}  [{'core' if m.core else 'full'}] {m.guards}")
        return 0
    names = [m.name for m in MUTATIONS]
    if len(set(names)) != len(names):
        raise SystemExit("mutations: duplicate names in tests/mutations.py")
    if args.check:
        stale = []
        for m in chosen:
            try:
                mutated_source(m, (ROOT / m.path).read_text())
            except StaleMutation as exc:
                stale.append(str(exc))
        print("\n".join(f"STALE     {s}" for s in stale) or f"mutations: all {len(chosen)} apply")
        return 1 if stale else 0
    scratches = [_scratch() for _ in range(max(1, args.jobs))]
    start = time.monotonic()
    try:
        if args.baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            verdict, detail = _run_tests(scratches[0], tests, False, args.timeout * 4)
            print(f"baseline: {verdict} {detail}", flush=True)
            if verdict != "passed":
                return 2
        free: queue.Queue[Path] = queue.Queue()
        for scratch in scratches:
            free.put(scratch)

        def attempt(m: Mutation) -> tuple[str, str, float]:
            scratch = free.get()  # a copy of the repository of this worker's own
            try:
                return _attempt(scratch, m, args.timeout)
            finally:
                free.put(scratch)

        counts = {"killed": 0, "survived": 0, "stale": 0}
        with ThreadPoolExecutor(len(scratches)) as pool:
            for m, (verdict, detail, took) in zip(chosen, pool.map(attempt, chosen), strict=True):
                if verdict == "error":
                    counts["stale"] += 1
                    print(f"STALE     {m.name}: {detail}", flush=True)
                elif verdict == "passed":
                    counts["survived"] += 1
                    print(f"SURVIVED  {m.name} ({m.target}; ran {' '.join(m.tests)}) [{took:.0f} s]", flush=True)
                else:
                    counts["killed"] += 1
                    how = "by a timeout" if verdict == "timeout" else f"by {detail}"
                    print(f"killed    {m.name} {how} [{took:.0f} s]", flush=True)
        print(f"mutations: {counts['killed']} killed, {counts['survived']} survived (of {len(chosen)})"
              + (f", {counts['stale']} stale" if counts["stale"] else "") + f" in {time.monotonic() - start:.0f} s")
        return 0 if counts["survived"] == counts["stale"] == 0 else 1
    finally:
        for scratch in scratches:
            shutil.rmtree(scratch, ignore_errors=True)


def _attempt(scratch: Path, m: Mutation, timeout: float) -> tuple[str, str, float]:
    """Apply ``m`` alone to ``scratch``, run its tests, put the file back: (verdict, detail, seconds)."""
    path = scratch / m.path
    original = path.read_text()
    t0 = time.monotonic()
    try:
        path.write_text(mutated_source(m, original))
    except StaleMutation as exc:
        return "error", str(exc), 0.0
    try:
        verdict, detail = _run_tests(scratch, m.tests, m.core, timeout)
    finally:
        path.write_text(original)
    if verdict == "error":
        detail = f"its tests did not run: {detail}"
    return verdict, detail, time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(main())
