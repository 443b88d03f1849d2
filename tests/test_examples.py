"""The examples run as documented, under torchrun, and check themselves against the unsharded model."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def case_fsdp_tp_training_example():
    """examples/train_fsdp_tp.py's training loop in the rank pool (its main() adds only torchrun's
    process group and mesh; torchrun itself is the README example's test)."""
    import warnings

    from tests.support.helpers import mesh

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worst, drift = _example("train_fsdp_tp").train(mesh((2, 2), ("dp", "tp")), steps=4, batch=4, seq=32)
    return worst, drift, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.slow
def test_fsdp_tp_training_example():
    """dp 2 x tp 2: AdamW, clipping and a schedule, loss, norm and parameters against torch's own step."""
    from tests.conftest import get_pool

    for worst, drift, future in get_pool(4).run(case_fsdp_tp_training_example):
        assert worst < 1e-4 and drift < 1e-3, (worst, drift)
        assert not future, future


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
    from tests.support.helpers import mesh

    return _example("jvp_fsdp_tp").check(mesh((2, 2), ("dp", "tp")))


@pytest.mark.slow
def test_jvp_objective_and_hvp_through_fsdp_times_tp():
    """A loss built from torch.func.jvp inside it (reverse over forward) and H v (forward over
    reverse) through FSDP x TP at dp 2 x tp 2, against the same on one device."""
    from tests.conftest import get_pool

    for d in get_pool(4).run(case_jvp_example):
        assert d["value"] < 1e-5 and d["grad"] < 1e-4 and d["hvp"] < 1e-4, d


def case_grpo_example():
    """examples/grpo.py's loop in the rank pool: sampling at TP (dp replicas), training at FSDP x TP, resharded in memory."""
    from tests.support.helpers import mesh

    return _example("grpo").train(mesh((2, 2), ("dp", "tp")))


@pytest.mark.slow
def test_grpo_example_equals_the_loop_on_one_device():
    """3 GRPO iterations at dp 2 x tp 2: every sampled token and the parameters after them equal the same
    loop on the unsharded model (model.generate under the same hpf.rng streams, torch.optim.AdamW)."""
    from tests.conftest import get_pool

    for out in get_pool(4).run(case_grpo_example):
        assert out["tokens_equal"] and out["param_diff"] < 1e-3, out
        assert len(out["mean_reward"]) == 3


def case_dp_sgd_example():
    """examples/dp_sgd.py's steps in the rank pool at dp 2 x tp 2 (ghost norms, FSDP x TP, noise by global index)."""
    from tests.support.helpers import mesh

    return _example("dp_sgd").train(mesh((2, 2), ("dp", "tp")), steps=2, log=lambda line: None)


@pytest.mark.slow
def test_dp_sgd_example_equals_the_steps_on_one_device():
    """DP-SGD at dp 2 x tp 2 (per-example clipping, noise): the parameters after 2 steps and every per-example
    norm equal the same steps on one device (a padded lookup of a vocab-parallel embedding included)."""
    from tests.conftest import get_pool

    for drift, worst_norm in get_pool(4).run(case_dp_sgd_example):
        assert drift < 1e-5 and worst_norm < 1e-4, (drift, worst_norm)
