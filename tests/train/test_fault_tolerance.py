"""Fault tolerance on torchft (hp_functional/train/fault_tolerance.py, docs/fault-tolerance.md).

Two replica groups x tp 2 (four processes forked from the rank pool's forkserver, each group its
own gloo world; ``tests/support/ft_worker.py``), the torchft Lighthouse started and stopped here on
a loopback port.  The test kills one process of a group as a crash would (SIGKILL at a chosen step),
kills the rest of that group (as torchrun's agent does) and restarts it; the other group never
stops.  Checked: every group ends with bitwise the same params, optimizer state and step; the
survivor committed every step once, some of them alone; its trajectory (loss at every committed
step, final state) equals a fault-free single-process run over the steps it committed, with the
groups that took part in each.  Skipped without torchft (the ``torchft`` extra).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason="the torchft extra is not installed (pip install -e '.[torchft]')")

import hp_functional as hpf
from hp_functional.train.fault_tolerance import FaultTolerant, _check_grads, _check_params, received
from tests.conftest import get_pool
from tests.support import ft_worker
from tests.support.helpers import mesh
from tests.support.models import MLP, PLANS, make_mlp_state
from tests.support.rank_pool import _context

TP, STEPS, DEADLINE = 2, 6, 240.0


class _Info:  # the one field the local checks read
    def __init__(self, local_shape):
        self.local_shape = local_shape


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Groups:
    """The replica groups' processes: started, watched, killed and restarted as a torchrun agent would."""

    def __init__(self, cfg: dict):
        self.cfg, self.ctx, self.procs, self.attempts = cfg, _context(), {}, {}

    def start(self, replica: int) -> None:
        attempt = self.attempts[replica] = self.attempts.get(replica, -1) + 1
        port = _free_port()
        self.procs[replica] = [self.ctx.Process(target=ft_worker.run_rank, args=(self.cfg, replica, attempt, r, port),
                                                daemon=True) for r in range(TP)]
        for p in self.procs[replica]:
            p.start()

    def failed(self, replica: int) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs[replica])

    def done(self, replica: int) -> bool:
        return all(p.exitcode == 0 for p in self.procs[replica])

    def stop(self, replica: int) -> list[int | None]:
        """Kill what is left of the group; the exit codes (-9: killed)."""
        for p in self.procs[replica]:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
        return [p.exitcode for p in self.procs[replica]]

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.cfg["out"])):
            if name.startswith("log_"):
                with open(os.path.join(self.cfg["out"], name), errors="replace") as f:
                    out.append(f"--- {name} ---\n" + "".join(f.readlines()[-15:]))
        return "\n".join(out)


def _progress(cfg: dict, replica: int) -> list[tuple[int, int]]:
    try:
        with open(os.path.join(cfg["out"], f"progress_{replica}")) as f:
            return [tuple(map(int, line.split())) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _drive(groups: Groups, restarts: int) -> list[list[int | None]]:
    """Run both groups to the end: group 1 restarted ``restarts`` times after each crash, once the survivor
    (group 0) has committed a step alone since; the exit codes of each crashed attempt of group 1."""
    cfg, crashed, waiting, gone = groups.cfg, [], None, False
    for r in (0, 1):
        groups.start(r)
    end = time.monotonic() + DEADLINE
    while not (groups.done(0) and (gone or groups.done(1))):
        assert time.monotonic() < end, "the run did not finish in time\n" + groups.logs()
        assert not groups.failed(0), "the survivor stopped\n" + groups.logs()
        if not gone and waiting is None and groups.failed(1):
            crashed.append(groups.stop(1))
            gone = len(crashed) > restarts
            waiting = None if gone else len(_progress(cfg, 0))
        if waiting is not None and any(n == 1 for _, n in _progress(cfg, 0)[waiting:]):
            groups.start(1)
            waiting = None
        time.sleep(0.05)
    return crashed


@pytest.fixture(scope="module")
def lighthouse():
    """A torchft Lighthouse on a loopback port (min 1 replica: a lone survivor commits), stopped after the tests."""
    from torchft.coordination import LighthouseServer

    port = _free_port()
    server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=50,
                              heartbeat_timeout_ms=2000)
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


def _config(tmp_path, lighthouse: str, kill: dict, want: int) -> dict:
    return {"out": str(tmp_path), "tp": TP, "steps": STEPS, "want": want, "kill": kill, "lighthouse": lighthouse,
            "timeout": 20, "quorum_timeout": 60, "max_tries": 200, "groups": 2, "pause": 0.05}


def _reference(log: list[tuple[int, int, float]], alone: int) -> tuple[dict, object, list[float]]:
    """The fault-free single-process run over ``log``'s committed steps: each step's gradient the mean over
    the groups that took part (both, or ``alone`` by itself), unsharded; its params, AdamW state and losses."""
    model = MLP()
    model.load_state_dict(make_mlp_state())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = hpf.optim.adamw(ft_worker.LR)
    state, losses = opt.init(params), []

    def loss(p, x):
        return torch.func.functional_call(model, p, (x,)).pow(2).mean()

    for step, n, _ in log:
        replicas = (0, 1) if n == 2 else (alone,)
        per = [torch.func.grad_and_value(loss)(params, ft_worker.batch(step, r)) for r in replicas]
        losses.append(per[replicas.index(alone)][1].item())
        grads = {k: sum(g[k] for g, _ in per) / len(per) for k in params}
        params, state = opt.update(grads, state, params)
    return params, state, losses


def _check_trajectory(result: dict, alone: int) -> None:
    log = result["log"]
    assert [s for s, _, _ in log] == list(range(log[0][0], log[-1][0] + 1)), f"a step committed twice or skipped: {log}"
    params, state, losses = _reference(log, alone)
    torch.testing.assert_close(torch.tensor([x for _, _, x in log]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
    for k in params:
        torch.testing.assert_close(result["params"][k], params[k], atol=1e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(result["mu"][k], state.mu[k], atol=1e-6, rtol=1e-4, msg=lambda m: f"mu {k}: {m}")
    assert int(result["opt_step"]) == int(state.step) == len(log)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and int(a["opt_step"]) == int(b["opt_step"])
    for part in ("params", "mu", "nu"):
        unequal = [k for k in a[part] if not torch.equal(a[part][k], b[part][k])]
        assert not unequal, f"{part} differ bitwise between the replica groups: {unequal}"


@pytest.mark.slow
def test_killed_replica_restarts_and_heals_while_the_survivor_goes_on(tmp_path, lighthouse):
    """Group 1's rank 1 dies at step 2 and the group restarts; its second start dies as it receives the
    survivor's state (torchft's recovery transfer) and restarts again; its third heals.  Group 0 never stops."""
    cfg = _config(tmp_path, lighthouse, {(1, 0): (1, 2), (1, 1): (1, "recv")}, want=2)
    crashed = _drive(Groups(cfg), restarts=2)
    assert len(crashed) == 2 and all(-signal.SIGKILL in codes for codes in crashed), crashed
    survivor, healed = (torch.load(tmp_path / f"replica{r}.pt", weights_only=True) for r in (0, 1))
    _assert_bitwise(survivor, healed)
    assert survivor["step"] >= STEPS and survivor["log"][-1][1] == 2
    assert [(s, n) for s, n, _ in survivor["log"][:2]] == [(0, 2), (1, 2)], survivor["log"]  # both, until the crash
    assert any(n == 1 for _, n, _ in survivor["log"]), survivor["log"]  # then alone, while group 1 was down
    assert healed["log"][0][0] > 2, "the restarted group started over instead of healing"
    _check_trajectory(survivor, alone=0)


@pytest.mark.slow
def test_a_replica_that_never_comes_back(tmp_path, lighthouse):
    """Group 1's rank 0 (its manager's host) dies at step 1 and stays dead: group 0 commits every step from then
    on alone, to the end, and its trajectory is the fault-free run's."""
    cfg = _config(tmp_path, lighthouse, {(1, 0): (0, 1)}, want=1)
    crashed = _drive(Groups(cfg), restarts=0)
    assert len(crashed) == 1 and -signal.SIGKILL in crashed[0], crashed
    survivor = torch.load(tmp_path / "replica0.pt", weights_only=True)
    assert survivor["step"] >= STEPS and survivor["log"][0][:2] == (0, 2) and survivor["log"][-1][1] == 1
    assert all(n == 1 for _, n, _ in survivor["log"][1:]), survivor["log"]
    _check_trajectory(survivor, alone=0)


def case_unreachable(port: int) -> tuple[str, str, float]:
    """Every rank: a Lighthouse that is not there is a ConnectionError naming it, within the connect timeout."""
    model = MLP()
    model.load_state_dict(make_mlp_state())
    _, params, info = hpf.shard(model, PLANS["tp"], mesh())
    opt = hpf.optim.adamw(1e-3)
    t = time.monotonic()
    try:
        FaultTolerant(opt, params, opt.init(params), info, replica_id="r", lighthouse=f"http://127.0.0.1:{port}",
                      connect_timeout=timedelta(seconds=1))
    except ConnectionError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t
    return "no error", "", time.monotonic() - t


@pytest.mark.slow
def test_lighthouse_unreachable_is_a_clear_error_on_every_rank():
    port = _free_port()  # nothing listens there
    for kind, msg, seconds in get_pool(2).run(case_unreachable, port, timeout=120):
        assert kind == "ConnectionError" and f"127.0.0.1:{port}" in msg and "not reachable" in msg, msg
        assert seconds < 30, seconds


def test_local_checks_come_before_torchft():
    """Bad arguments are refused by name before the Lighthouse or any process group is touched."""
    with pytest.raises(hpf.PlanError, match=r"missing from params \['w'\]"):
        FaultTolerant(hpf.optim.adamw(), {}, None, {"w": object()}, replica_id="r", lighthouse="http://x:1")
    w = torch.zeros(2, 3)
    with pytest.raises(hpf.PlanError, match="is not a tensor"):
        _check_params({"w": w}, {"step": 1}, {"w": _Info((2, 3))})
    with pytest.raises(hpf.PlanError, match=r"none for \['w'\]"):
        _check_grads({"w": None}, {"w": w})
    with pytest.raises(hpf.ShapeError, match=r"grads\['w'\] has shape \(3, 2\)"):
        _check_grads({"w": w.T}, {"w": w})


def test_a_peer_state_is_taken_only_at_this_replicas_layout():
    """What a healing replica receives is checked against its own layout, keys, shapes and dtypes (plain data:
    ``layout()``'s tuples), and then copied in, the optimizer state rebuilt with this replica's structure."""
    here = {"w": ((4, 4), (2, 4), (0, 0), "(Shard(dim=0),)", ("tp",), (2,), None)}
    opt = hpf.optim.adamw()
    params = {"w": torch.zeros(2, 4)}
    state = opt.init(params)
    sent = {"layout": dict(here), "params": {"w": torch.ones(2, 4)}, "opt_state": [torch.tensor(3), torch.ones(2, 4),
                                                                                    torch.full((2, 4), 2.0)]}
    new_params, new_state = received(sent, here, params, state)
    assert torch.equal(new_params["w"], sent["params"]["w"]) and int(new_state.step) == 3
    assert torch.equal(new_state.nu["w"], sent["opt_state"][2]) and torch.equal(params["w"], torch.zeros(2, 4))
    other = {"w": ((4, 4), (4, 4), (0, 0), "(Replicate(),)", ("tp",), (2,), None)}
    with pytest.raises(hpf.PlanError, match=r"lays out params\['w'\] as .*Replicate.*different layouts"):
        received({**sent, "layout": other}, here, params, state)
    with pytest.raises(hpf.PlanError, match=r"the peer has params \['v'\]"):
        received({**sent, "layout": {**here, "v": here["w"]}}, here, params, state)
    with pytest.raises(hpf.PlanError, match="2 leaves, this replica's 3"):
        received({**sent, "opt_state": sent["opt_state"][:2]}, here, params, state)
    with pytest.raises(hpf.PlanError, match=r"params\['w'\] is \(\(2, 4\), torch.float64\)"):
        received({**sent, "params": {"w": torch.ones(2, 4, dtype=torch.float64)}}, here, params, state)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HPF_SWEEP", "0") in ("", "0"),
                    reason="on demand (HPF_SWEEP=1): two torchruns of examples/fault_tolerant.py, ~1-2 min on 2 cores")
def test_the_example_under_torchrun(tmp_path, lighthouse):
    """examples/fault_tolerant.py as its docstring runs it: two torchruns (tp 2 each) and the Lighthouse; group 1's
    last rank dies, torchrun restarts the group, it heals; both groups end with the same state digest."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_LIGHTHOUSE=lighthouse,
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    runs = []
    for group, extra in ((0, []), (1, ["--crash-at", "3"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "--max-restarts", "2", str(root / "examples" / "fault_tolerant.py"), "--steps", "8",
               "--max-steps", "20000", *extra]
        log = open(tmp_path / f"group{group}.log", "w")
        runs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "REPLICA_GROUP_ID": str(group)},
                                      cwd=root), log))
    try:
        codes = [proc.wait(timeout=400) for proc, _ in runs]
    finally:
        for proc, log in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    out = [(tmp_path / f"group{g}.log").read_text() for g in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in out)
    done = [re.search(r"^group \d done: step (\d+) loss \S+ state (\w+)$", o, re.M) for o in out]
    assert all(done) and done[0].groups() == done[1].groups(), [d and d.group(0) for d in done]
    assert "exitcode: -9" in out[1], out[1][-3000:]
