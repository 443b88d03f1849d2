"""The examples run as documented, under torchrun, and check themselves against the unsharded model."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fsdp_tp_training_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_fsdp_tp.py"), "--tp", "2", "--steps", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dp 2 x tp 2: max |loss or norm diff|" in run.stdout, run.stdout
    assert "tok_s=" in run.stderr, run.stderr[-3000:]  # tqdm's bar, with the throughput
    assert "FutureWarning" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_torchtitan_llama_example_under_torchrun():
    """torchtitan's own Llama 3 with its own apply_tp plan, FSDP x TP, vs the unsharded model (the titan extra)."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed: pip install -e '.[titan]' (docs/torchtitan.md)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "torchtitan_llama.py"), "--tp", "2", "--steps", "3"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torchtitan llama3 dp 2 x tp 2:" in run.stdout, run.stdout


def case_jvp_example():
    """examples/jvp_fsdp_tp.py's check in the rank pool (the script itself is the same under torchrun)."""
    import importlib.util

    from tests.support.helpers import mesh

    spec = importlib.util.spec_from_file_location("jvp_fsdp_tp", ROOT / "examples" / "jvp_fsdp_tp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.check(mesh((2, 2), ("dp", "tp")))


@pytest.mark.slow
def test_jvp_objective_and_hvp_through_fsdp_times_tp():
    """A loss built from torch.func.jvp inside it (reverse over forward) and H v (forward over
    reverse) through FSDP x TP at dp 2 x tp 2, against the same on one device."""
    from tests.conftest import get_pool

    for d in get_pool(4).run(case_jvp_example):
        assert d["value"] < 1e-5 and d["grad"] < 1e-4 and d["hvp"] < 1e-4, d
