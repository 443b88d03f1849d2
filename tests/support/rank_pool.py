"""A pool of gloo ranks that run many test cases each (a process start costs seconds).

The ranks are forked from one forkserver that imported torch, transformers and hp_functional
once (``_PRELOAD``), not spawned: each rank then starts in a fraction of a second instead of
importing them again (4 ranks on 2 cores: ~10 s less per pool).  The forkserver is a fresh
interpreter, not a fork of the test process: nothing the tests did there (threads, modes,
patches) reaches the ranks.

``pool.run(fn, *args)`` pickles ``fn`` by reference, runs it on every rank and returns the list
of per-rank results.  An exception on any rank is re-raised here with every failing rank's
traceback; a case that outlives ``timeout`` kills the pool (so nothing hangs) and raises.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import torch.multiprocessing as mp

#: what the forkserver imports before it forks the ranks (a missing one is skipped)
_PRELOAD = ["torch", "torch.distributed", "transformers", "hp_functional", "tests.support.helpers",
            "transformers.models.llama.modeling_llama"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, pg_timeout: float, inbox, outbox) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test process
            outbox.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """A case failed on one or more ranks; the message holds each rank's traceback."""


class RankPool:
    """``world`` long-lived gloo ranks on this machine; every collective they issue gives up
    after ``pg_timeout`` seconds (the process group's timeout), so a case cannot hang them."""

    def __init__(self, world: int, pg_timeout: float = 120.0):
        self.world = world
        self.pg_timeout = pg_timeout
        self._ctx = _context()
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._outbox = self._ctx.Queue()
        self._inboxes = [self._ctx.Queue() for _ in range(self.world)]
        self._procs = [
            self._ctx.Process(
                target=_worker, args=(r, self.world, port, self.pg_timeout, self._inboxes[r], self._outbox), daemon=True
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        pickle.dumps((fn, args, kwargs))  # fail here, not silently in the queue's feeder thread
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, tuple[bool, object]] = {}
        while len(results) < self.world:
            try:
                rank, ok, value = self._outbox.get(timeout=timeout)
            except queue.Empty:
                self.restart()
                raise RankFailure(f"{fn.__name__} timed out after {timeout}s; ranks done: {sorted(results)}") from None
            results[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        if failed:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failed.items())))
        return [results[r][1] for r in range(self.world)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for box in self._inboxes:
                box.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
