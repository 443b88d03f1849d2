"""The hp-functional command line: ``plan`` and ``check`` as subprocesses (the console script),
option variants in process."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from hp_functional.cli.main import main
from hp_functional.tools.models import tiny_config

C = tiny_config("llama")


def _row(text: str, *cells: str) -> bool:
    """Whether a table row holds ``cells`` in this order (rich draws box characters between)."""
    return re.search(r"\W+".join(re.escape(c) for c in cells) + r"(\W|$)", text) is not None


def _script() -> list[str]:
    exe = shutil.which("hp-functional")
    return [exe] if exe else [sys.executable, "-m", "hp_functional.cli"]


def test_plan_subprocess_prints_placements_schedule_and_memory():
    seq = 16
    res = subprocess.run([*_script(), "plan", "llama", "--tp", "2", "--seq", str(seq)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    h, v, L = C.hidden_size, C.vocab_size, C.num_hidden_layers
    assert "mesh {'tp': 2}" in out
    assert _row(out, "model.layers.*.self_attn.o_proj", "Rowwise()", "tp", str(L))
    assert _row(out, "model.layers.0.self_attn.q_proj.weight", f"({h}, {h})", "S(0)", f"({h // 2}, {h})")
    assert _row(out, "model.layers.1.mlp.down_proj.weight", f"({h}, {C.intermediate_size})", "S(1)",
                f"({h}, {C.intermediate_size // 2})")
    assert _row(out, "model.norm.weight", f"({h},)", "R", f"({h},)")
    assert _row(out, "model.layers.1.mlp.down_proj", "fwd", "all_reduce", "tp", f"{seq * h * 4 / 1024:.2f} KiB")
    assert _row(out, "fwd", "all_reduce", "tp", str(2 * L + 1))  # totals: Megatron's two per block + the embedding
    assert _row(out, "fwd", "all_gather", "tp", "1", f"{seq * v * 4 / 1024:.2f} KiB")  # the logits
    replicated = (2 * L + 1) * h * 4
    assert _row(out, "replicated", f"{replicated / 1024:.2f} KiB")


def test_check_subprocess_validates_on_gloo_ranks():
    res = subprocess.run([*_script(), "check", "llama", "--tp", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "validate (numeric): ok" in res.stdout
    assert _row(res.stdout, "ok", "grad", "model.layers.1.self_attn.o_proj.weight")


def test_plan_from_config_json_on_a_2d_mesh(tmp_path, capsys):
    cfg = tiny_config("qwen3").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", str(tmp_path), "--tp", "2", "--dp", "2", "--brief", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "mesh {'dp': 2, 'tp': 2}" in out
    assert _row(out, "model.layers.0.self_attn.q_norm.weight", "(8,)", "R", "R", "(8,)")  # per-head norm: replicated
    assert _row(out, "model.layers.0.self_attn.k_proj.weight", "(32, 64)", "R", "S(0)", "(16, 64)")
    assert "communication schedule" not in out  # --brief: totals only
    assert _row(out, "bwd", "all_reduce", "tp")  # q_norm/k_norm grads are all-reduced too


def test_plan_with_a_custom_plan_and_lint_errors(capsys):
    assert main(["plan", "llama", "--tp", "2", "--plan", "hp_functional:llama_sp_plan", "--brief"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "fwd", "reduce_scatter", "tp", str(2 * C.num_hidden_layers))
    assert main(["plan", "llama", "--tp", "8"]) == 1  # 4 KV heads of 8 cannot split 8 ways
    out = capsys.readouterr().out
    assert "error: model.layers.*.self_attn.k_proj" in out and "head_dim=8" in out and "parameters" not in out


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="neither a built-in tiny model"):
        main(["plan", "gpt-9", "--tp", "2"])
