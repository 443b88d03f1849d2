"""State is passed, not reached for: no ``global`` statement and no thread-local anywhere in
hp_functional (an allow-list names the one thread-local and says why it is not a channel); the
probe's verdicts go through ``ProbeCache``'s methods, on a cache its caller owns and passes (no
process-wide default)."""

import ast
import inspect
import pathlib
import sys

import hp_functional as hpf
from hp_functional.runtime import probe
from hp_functional.runtime.probe import ProbeCache, Verdict

PACKAGE = pathlib.Path(hpf.__file__).parent

#: file (relative to the package) -> why it may hold a thread-local
THREAD_LOCAL_ALLOWED = {
    "runtime/apply_fn.py": "a one-rank apply_fn called from another thread builds that thread a private skeleton and "
                           "keeps it for the thread's life; the thread-local is a closure's own store, read only by "
                           "that apply_fn on the calling thread, and freed with the thread (no value crosses calls)",
}


def _hidden_state(tree: ast.AST) -> tuple[list[int], list[int]]:
    """(lines of ``global`` statements, lines that name ``threading.local``) in a module."""
    globals_, locals_ = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            globals_.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "local" and isinstance(node.value, ast.Name) \
                and node.value.id == "threading":
            locals_.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "threading" and any(a.name == "local" for a in node.names):
            locals_.append(node.lineno)
    return globals_, locals_


def test_no_global_statements_or_thread_locals():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        globals_, locals_ = _hidden_state(ast.parse(path.read_text(), rel))
        found += [f"{rel}:{line}: global statement" for line in globals_]
        if rel not in THREAD_LOCAL_ALLOWED:
            found += [f"{rel}:{line}: threading.local" for line in locals_]
    assert not found, "state must be passed, not reached for (docs/../DESIGN principle):\n" + "\n".join(found)


def test_the_scan_sees_what_it_forbids():
    """The scan itself: a global statement and both spellings of a thread-local are found."""
    src = "import threading\nfrom threading import local\nx = 0\ndef f():\n    global x\n    x = threading.local()\n"
    assert _hidden_state(ast.parse(src)) == ([5], [2, 6])
    for rel in THREAD_LOCAL_ALLOWED:  # the allow-list names files that exist and still need it
        assert _hidden_state(ast.parse((PACKAGE / rel).read_text()))[1], rel


def test_probe_cache_remembers_through_its_methods():
    exact, skipped = Verdict(True, "exact on the probe copy"), Verdict(False, "skipped: ...")
    cache = ProbeCache(size=2)
    assert cache.lookup("a") is None
    cache.record("a", exact)
    cache.record("b", skipped)
    assert cache.lookup("a") is exact  # now the most recently used
    cache.record("c", exact)  # "b" goes first
    assert cache.lookup("b") is None and cache.lookup("a") is not None and len(cache) == 2
    again = exact.remembered()
    assert again.compared and str(again) == "exact on the probe copy (probed before in this process: same structure, " \
                                           "plan and mesh)"


def test_no_process_wide_probe_cache():
    """``shard()`` remembers proofs only in a ``ProbeCache`` its caller passes: no module holds one."""
    assert inspect.signature(hpf.shard).parameters["probe_cache"].default is None
    held = [f"{m.__name__}.{name}" for m in (probe, sys.modules[hpf.shard.__module__])
            for name, value in vars(m).items() if isinstance(value, ProbeCache)]
    assert not held, held


def test_an_async_save_handle_releases_its_own_lane():
    """``wait()`` frees the lane it was held on (so the next save does not wait for it), and only
    that handle: the lane is passed to the handle, not found through module state."""
    from concurrent.futures import Future

    from hp_functional.train.dcp import AsyncLane, SaveHandle

    lane, done = AsyncLane(group=None), Future()
    done.set_result(None)
    first = lane.hold(SaveHandle("a", done, lambda: None, lane))
    lane.release(SaveHandle("b", done, lambda: None, lane))  # another handle: the lane keeps its own
    assert lane.pending is first
    lane.finish_pending()
    assert lane.pending is None and first.done() and first.wait() == "a"
