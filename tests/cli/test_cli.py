"""The hp-functional command line through the installed console script (subprocesses), a few
option variants in process, the package's lazy import, and the Makefile's set-up."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hp_functional
from hp_functional.cli import main as cli_main
from hp_functional.cli.main import main
from hp_functional.tools.models import tiny_config
from hp_functional.tools.tables import collapsed_params

ROOT = Path(__file__).resolve().parents[2]
C = tiny_config("llama")

# a Llama-3-8B-shaped config (built on the meta device by ``plan``: nothing is allocated)
LLAMA_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


def _row(text: str, *cells: str) -> bool:
    """Whether a table row holds ``cells`` in this order (rich draws box characters between)."""
    return re.search(r"\W+".join(re.escape(c) for c in cells) + r"(\W|$)", text) is not None


def _script() -> list[str]:
    """The installed console script (``pip install -e .`` puts it beside the interpreter)."""
    exe = shutil.which("hp-functional", path=str(Path(sys.executable).parent)) or shutil.which("hp-functional")
    assert exe, "the hp-functional console script is not installed (pip install -e .)"
    return [exe]


def _run(*args: str, timeout: int = 180, cwd: Path | None = None, env: dict | None = None):
    return subprocess.run([*_script(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def _launches() -> dict[str, list[str]]:
    """The console runs of the subprocess tests below (test name: command), each mostly process start-up."""
    return {
        "test_plan_subprocess_prints_placements_schedule_and_memory": [*_script(), "plan", "llama", "--tp", "2",
                                                                       "--seq", "16"],
        "test_check_subprocess_validates_on_gloo_ranks": [*_script(), "check", "llama", "--tp", "2"],
        "test_demo_console_script_trains_and_prints_no_future_warning": [*_script(), "demo", "--steps", "3"],
        "test_demo_under_torchrun_through_python_m": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc-per-node", "2", "-m", "hp_functional.cli", "demo",
                                                      "--steps", "2"],
    }


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Those of ``_launches()`` whose tests are selected, all started when the first of them runs,
    so that their start-ups overlap each other and the in-process tests between (as separate
    processes they are the same runs); each test then waits for its own (``_finished``)."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    logs = tmp_path_factory.mktemp("cli_runs")
    procs = {}
    for name, cmd in _launches().items():
        if name in selected:
            with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
    yield logs, procs
    for proc in procs.values():
        if proc.poll() is None:  # a test that failed before waiting, or timed out
            proc.kill()
            proc.wait()


def _finished(launched, name: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The run of test ``name`` started by ``launched``, once it has exited (killed at the fixture's end if not)."""
    logs, procs = launched
    procs[name].wait(timeout=timeout)
    return subprocess.CompletedProcess(procs[name].args, procs[name].returncode, (logs / f"{name}.out").read_text(),
                                       (logs / f"{name}.err").read_text())


# ---------------------------------------------------------------- start-up: lazy package, fast --help
def test_help_is_fast_plain_text_and_explains_batch_and_seq():
    _run("--help")  # warm the file cache
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = _run("--help")
        times.append(time.perf_counter() - t0)
        assert res.returncode == 0, res.stderr
    assert min(times) < 1.5, f"hp-functional --help took {min(times):.2f} s"
    assert "demo" in res.stdout and "plan" in res.stdout and "check" in res.stdout
    for sub in ([], ["demo"], ["plan"], ["check"]):
        out = _run(*sub, "--help").stdout
        assert "``" not in out, out  # plain text, not RST
    plan_help = " ".join(_run("plan", "--help").stdout.split())
    assert "--batch B sequences in this rank's example input_ids (default: 1)" in plan_help
    assert "--seq S tokens per sequence in this rank's example input_ids (default: 128)" in plan_help


def test_cli_module_imports_no_torch():
    code = "import sys, hp_functional.cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'transformers', 'rich', 'tqdm')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


@pytest.mark.slow
def test_import_hp_functional_adds_nothing_heavy_beyond_torch():
    """``import hp_functional`` is lazy: after ``import torch`` (which imports tqdm through torch.hub
    on its own) it imports no rich, tqdm or transformers module that torch did not."""
    code = ("import sys, torch; before = set(sys.modules); import hp_functional; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('rich', 'tqdm', 'transformers', "
            "'torch')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_lazy_package_exports_every_name():
    """The imports of ``__init__.py``'s ``TYPE_CHECKING`` block are the one export table: ``__all__``
    is exactly their names, once each, and each name resolves (on first use) to the object its
    import line names, a submodule for ``collectives`` and ``optim``."""
    import importlib
    import types

    from hp_functional import collectives, shard  # noqa: F401 - the from-import form works

    init = ast.parse((ROOT / "hp_functional" / "__init__.py").read_text())
    typed = [(a.asname or a.name, stmt.module, a.name) for node in init.body if isinstance(node, ast.If)
             for stmt in node.body if isinstance(stmt, ast.ImportFrom) for a in stmt.names]
    names = [name for name, _, _ in typed]
    assert len(names) == len(set(names)) and hp_functional.__all__ == sorted(names)
    assert set(names) <= set(dir(hp_functional))
    for name, module, attribute in typed:
        source = importlib.import_module(f"hp_functional.{module}")
        expected = getattr(source, attribute, None) or importlib.import_module(f"hp_functional.{module}.{attribute}")
        assert getattr(hp_functional, name) is expected, name
    modules = {n for n in names if isinstance(getattr(hp_functional, n), types.ModuleType)}
    assert modules == {"collectives", "optim"}, modules  # shard is the function
    assert collectives is hp_functional.collectives and collectives.__name__ == "hp_functional.core.collectives"
    assert hp_functional.llama_sp_plan is cli_main.importlib.import_module("hp_functional.plan.recipes").llama_sp_plan
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hp_functional.nope  # noqa: B018
    for old in ("Checkpoint", "ActivationCheckpoint"):  # earlier names are gone (docs/changelog.md)
        with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
            getattr(hp_functional, old)


def test_public_signatures_share_one_order_and_role_named_axes():
    """Every public function names a mesh-axis keyword by the role the axis plays there (tp_axis,
    cp_axis, ep_axis, dp_axis, pp_axis); a bare ``axis=`` is a style's own axis only, and ``axes=``
    only ``ShardingPlan``'s map from role to axis."""
    import inspect

    functions = {n: getattr(hp_functional, n) for n in hp_functional.__all__ if inspect.isfunction(getattr(hp_functional, n))}
    functions.update({f"ShardingPlan.{m}": getattr(hp_functional.ShardingPlan, m) for m in ("__init__", "from_hf", "from_torch")})
    bare = {n: p for n, f in functions.items() for p in inspect.signature(f).parameters
            if p == "axis" or (p == "axes" and n != "ShardingPlan.__init__")}
    assert not bare, bare
    roles = {p for f in functions.values() for p in inspect.signature(f).parameters if p.endswith("_axis")}
    assert roles == {"tp_axis", "cp_axis", "ep_axis", "dp_axis", "pp_axis"}, roles
    for name, f in functions.items():  # (model or path, [stage,] plan, mesh), shard's order
        params = list(inspect.signature(f).parameters)
        if "plan" in params and "mesh" in params:
            assert params.index("plan") < params.index("mesh") and params[0] in ("model", "path", "self"), (name, params)


def undocumented(fn) -> list[str]:
    """What ``fn``'s docstring lacks: an ``Args:`` line per parameter (``a, b: ...`` may share
    one) and a ``Returns:`` section unless it returns None."""
    import inspect

    doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    named = set()
    if start is not None:
        for line in lines[start + 1:]:
            if line.strip() and not line.startswith(" "):
                break
            found = re.match(r"^ {4}([\w*, ]+):", line)
            if found:
                named |= {n.strip().lstrip("*") for n in found.group(1).split(",")}
    missing = [p for p in sig.parameters if p not in ("self", "cls") and p not in named]
    if sig.return_annotation not in (None, "None") and not any(line.strip() == "Returns:" for line in lines):
        missing.append("Returns:")
    return missing


def test_public_functions_document_args_and_returns():
    """Every public function says what each argument is and what it returns (Google style)."""
    import inspect

    functions = {n: getattr(hp_functional, n) for n in hp_functional.__all__ if inspect.isfunction(getattr(hp_functional, n))}
    functions.update({f"ShardingPlan.{m}": getattr(hp_functional.ShardingPlan, m) for m in ("from_hf", "from_torch")})
    gaps = {name: missing for name, f in functions.items() if (missing := undocumented(f))}
    assert not gaps, gaps


# ---------------------------------------------------------------- plan
@pytest.mark.slow
def test_plan_subprocess_prints_placements_schedule_and_memory(launched):
    seq = 16  # the run's --seq (_launches)
    res = _finished(launched, "test_plan_subprocess_prints_placements_schedule_and_memory")
    assert res.returncode == 0, res.stderr
    assert "FutureWarning" not in res.stderr and "[rank" not in res.stderr, res.stderr
    out = res.stdout
    h, v, L = C.hidden_size, C.vocab_size, C.num_hidden_layers
    assert "mesh {'tp': 2}" in out
    assert f"batch 1 x seq {seq}" in out and "parameters in float32" in out
    assert "note:" not in out  # no dp axis: nothing left out of the totals
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


@pytest.mark.slow
def test_plan_with_the_packaged_sp_plan(capsys):
    """In this process (the console script's own path is ``test_plan_subprocess_...``'s)."""
    assert main(["plan", "llama", "--tp", "2", "--plan", "hp_functional:llama_sp_plan", "--brief", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "model.layers.*.mlp.down_proj", "Rowwise(output_layout=Shard(dim=1))", "tp", "2")
    assert _row(out, "fwd", "reduce_scatter", "tp", str(2 * C.num_hidden_layers))


@pytest.mark.slow
def test_brief_merges_layers_states_the_step_and_the_dp_reduction_left_out(tmp_path, capsys):
    """An 8B Llama's shapes (4 of its 32 layers: tracing all 32 on fake tensors takes 15 s more, the
    rows are the same), printed as one row per layer-index pattern."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "num_hidden_layers": 4}))
    assert main(["plan", str(tmp_path), "--tp", "8", "--dp", "2", "--brief", "--dtype", "bfloat16", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "mesh {'dp': 2, 'tp': 8}" in out and "batch 1 x seq 64" in out and "parameters in bfloat16" in out
    assert _row(out, "model.layers.*.mlp.down_proj.weight", "4", "(4096, 14336)", "R", "S(1)", "(4096, 1792)")
    assert _row(out, "model.layers.*.self_attn.k_proj.weight", "4", "(1024, 4096)", "R", "S(0)", "(128, 4096)")
    assert _row(out, "model.embed_tokens.weight", "1", "(128256, 4096)", "R", "S(0)", "(16032, 4096)")
    assert re.search(r"model\.layers\.\d", out) is None, out  # every layer's rows merged
    assert len(out.splitlines()) < 80, out  # tens of rows, not one per parameter
    assert "communication schedule" not in out  # totals only
    note = " ".join(out[out.index("note:"):].split())
    assert "data-parallel gradient reduction over dp=2" in note and "not in these totals" in note
    assert "acts only on its own axes (tp)" in note


def test_plan_from_config_json_on_a_2d_mesh(tmp_path, capsys):
    cfg = tiny_config("qwen3").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", str(tmp_path), "--tp", "2", "--dp", "2", "--brief", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "mesh {'dp': 2, 'tp': 2}" in out and "parameters in bfloat16" in out
    assert _row(out, "model.layers.*.self_attn.q_norm.weight", "2", "(8,)", "R", "R", "(8,)")  # per-head norm
    assert _row(out, "model.layers.*.self_attn.k_proj.weight", "2", "(32, 64)", "R", "S(0)", "(16, 64)")
    assert "communication schedule" not in out  # --brief: totals only
    assert _row(out, "bwd", "all_reduce", "tp")  # q_norm/k_norm grads are all-reduced too
    assert "gradient reduction over dp=2" in " ".join(out.split())


@pytest.mark.slow
def test_plan_with_the_megatron_recipe_and_lint_errors(capsys):
    assert main(["plan", "llama", "--tp", "2", "--plan", "hp_functional:megatron_plan", "--brief", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    L = C.num_hidden_layers
    assert _row(out, "fwd", "all_reduce", "tp", str(2 * L + 1)) and _row(out, "bwd", "all_reduce", "tp", str(2 * L + 1))
    assert main(["plan", "llama", "--tp", "8"]) == 0  # 4 KV heads over 8 ranks: each held by 2 (KV-head replication)
    assert "GroupedShard(dim=0, replicas=2)" in capsys.readouterr().out
    assert main(["plan", "llama", "--tp", "16"]) == 1  # 8 query heads of 8 cannot split 16 ways
    out = capsys.readouterr().out
    assert "error: model.layers.*.self_attn.q_proj" in out and "head_dim=8" in out and "global shape" not in out


def test_collapsed_params_keeps_differently_placed_layers_apart():
    from types import SimpleNamespace

    def info(shape, placement):
        return SimpleNamespace(aliases=(), global_shape=shape, local_shape=shape, placements=(placement,))

    program = SimpleNamespace(infos={
        "model.layers.0.mlp.w": info((4, 4), "S(0)"), "model.layers.1.mlp.w": info((4, 4), "S(0)"),
        "model.layers.2.mlp.w": info((4, 4), "R"), "model.norm.weight": info((4,), "R"),
    })
    assert collapsed_params(program) == [
        ("model.layers.*.mlp.w", 2, ("(4, 4)", "S(0)", "(4, 4)")),
        ("model.layers.*.mlp.w", 1, ("(4, 4)", "R", "(4, 4)")),
        ("model.norm.weight", 1, ("(4,)", "R", "(4,)")),
    ]


# ---------------------------------------------------------------- errors: one line, no traceback
@pytest.mark.slow
def _main_error(capsys, *args: str) -> str:
    """``main(args)`` in this process returned 2 with exactly one ``hp-functional: error: ...``
    line (the console script's own path, with its exit code and output, is the subprocess tests')."""
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp-functional: error: "), lines
    return lines[0]


def test_bad_plan_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "myplans.py").write_text("answer = 42\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])  # main adds the cwd
    assert "no module named 'no_such_module_xyz'" in _main_error(capsys, "plan", "llama", "--plan", "no_such_module_xyz:plan")
    assert "'hp_functional' has no attribute 'no_such_plan'" in _main_error(capsys, "plan", "llama", "--plan",
                                                                            "hp_functional:no_such_plan")
    monkeypatch.chdir(tmp_path)  # a module in the cwd
    assert "is 42 (int), not a ShardingPlan" in _main_error(capsys, "plan", "llama", "--plan", "myplans:answer")
    monkeypatch.chdir(ROOT)
    assert "expected module:name" in _main_error(capsys, "check", "llama", "--plan", "hp_functional")  # before any rank


def test_unknown_model_and_dtype_are_one_line(capsys):
    assert "neither a built-in tiny model" in _main_error(capsys, "plan", "gpt-9", "--tp", "2")
    assert "not a torch dtype" in _main_error(capsys, "plan", "llama", "--dtype", "float33")


def test_plan_functions_that_fail_or_return_no_plan(tmp_path, capsys, monkeypatch):
    (tmp_path / "badplans.py").write_text(
        "def boom(model):\n    raise RuntimeError('kaput')\n"
        "def bogus():\n    return {'model.layers.*.mlp.up_proj': 'bogus'}\n"
        "def number():\n    return 7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "llama", "--plan", "badplans:boom"]) == 2
    assert re.fullmatch(r"hp-functional: error: --plan 'badplans:boom': boom\(model\) raised RuntimeError: kaput "
                        r"\(.*badplans.py:2\)\n", capsys.readouterr().err)
    assert main(["plan", "llama", "--plan", "badplans:bogus"]) == 1  # a PlanError from the plan itself
    assert capsys.readouterr().err.startswith("hp-functional: error: plan entry 'model.layers.*.mlp.up_proj': style "
                                              "'bogus' is not supported")
    assert main(["plan", "llama", "--plan", "badplans:number"]) == 2
    assert "returned 7 (int)" in capsys.readouterr().err


def test_a_plan_error_under_the_fake_process_group_is_one_line(monkeypatch, capsys):
    """init_process_group (the fake one included) installs a sys.excepthook that prefixes every
    traceback line with "[rank0]:" and destroy_process_group leaves it: main() catches PlanError
    and puts the hook back."""
    import hp_functional.tools.explain as explain_mod
    from hp_functional.core.errors import ShapeError

    def fail(*a, **k):
        raise ShapeError("model.layers.0.mlp: dim 1 of (1, 15, 64) is not divisible by 2")

    monkeypatch.setattr(explain_mod, "explain", fail)
    hook = sys.excepthook
    assert main(["plan", "llama", "--tp", "2"]) == 1
    assert capsys.readouterr().err == "hp-functional: error: model.layers.0.mlp: dim 1 of (1, 15, 64) is not divisible by 2\n"
    assert sys.excepthook is hook


@pytest.mark.slow
def test_an_unexpected_error_after_simulate_has_no_rank_prefix(monkeypatch, capsys):
    """An error main() does not handle leaves it as it came; by then the interpreter's hook is back,
    so the traceback the interpreter prints for it (``sys.excepthook``) has no "[rank0]:" prefix."""
    import hp_functional.tools.tables as tables

    def broken(*a, **k):
        raise RuntimeError("table broke")

    monkeypatch.setattr(tables, "memory_table", broken)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # the interpreter's, whatever ran before
    with pytest.raises(RuntimeError, match="table broke") as raised:
        main(["plan", "llama", "--seq", "16"])
    assert sys.excepthook is sys.__excepthook__, sys.excepthook
    capsys.readouterr()
    sys.excepthook(raised.type, raised.value, raised.tb)
    err = capsys.readouterr().err
    assert "RuntimeError: table broke" in err and "[rank0]" not in err, err


# ---------------------------------------------------------------- multi-rank: check and demo
@pytest.mark.slow
def test_check_subprocess_validates_on_gloo_ranks(launched):
    res = _finished(launched, "test_check_subprocess_validates_on_gloo_ranks")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "validate (numeric): ok" in res.stdout
    assert _row(res.stdout, "ok", "grad", "model.layers.1.self_attn.o_proj.weight")
    assert "FutureWarning" not in res.stderr, res.stderr  # all_gather_into_tensor's deprecation is gone


def _in_folder(folder: str, fn, *args):
    """``fn(*args)`` on a rank, with ``folder`` importable (as the spawned ranks inherit the cwd on sys.path)."""
    sys.path.insert(0, folder)
    sys.modules.pop("myplans", None)
    try:
        return fn(*args)
    finally:
        sys.path.remove(folder)
        sys.modules.pop("myplans", None)


@pytest.mark.slow
def test_check_reports_a_plan_error_from_the_ranks_as_one_line(tmp_path, capsys, monkeypatch):
    """``check``'s own code in this process, its ranks those of the rank pool instead of spawned
    ones (the spawning, the same ``check_rank`` on them, is ``test_check_subprocess_...``'s): the
    plan error raised on every rank comes back as one line and exit code 1, no traceback."""
    from tests.conftest import get_pool

    (tmp_path / "myplans.py").write_text("def nomatch():\n    return {'model.nothing.*': 'colwise'}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "myplans", raising=False)  # another test's myplans
    monkeypatch.setenv("HPF_BACKEND", "gloo")
    spawned = []

    def run_ranks(fn, nproc, *args):
        spawned.append(nproc)
        return dict(enumerate(get_pool(nproc).run(_in_folder, str(tmp_path), fn, *args)))

    monkeypatch.setattr("hp_functional.cli.launch.run_ranks", run_ranks)
    assert main(["check", "llama", "--tp", "2", "--plan", "myplans:nomatch"]) == 1
    out, err = capsys.readouterr()
    assert spawned == [2] and out == "", (spawned, out)
    assert len(err.splitlines()) == 1, err
    assert err.startswith("hp-functional: error: plan entry 'model.nothing.*' matches no module"), err


@pytest.mark.slow
def test_demo_console_script_trains_and_prints_no_future_warning(launched):
    res = _finished(launched, "test_demo_console_script_trains_and_prints_no_future_warning")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "max |loss diff|" in res.stdout
    assert "FutureWarning" not in res.stderr and "DeprecationWarning" not in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_demo_under_torchrun_through_python_m(launched):
    res = _finished(launched, "test_demo_under_torchrun_through_python_m")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "max |loss diff|" in res.stdout and "FutureWarning" not in res.stderr


# ---------------------------------------------------------------- set-up: Makefile and CI
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def _warn_from(module: str, category: type[Warning]) -> None:
    """``warnings.warn`` called from code whose module is ``module`` (what a filter's module field matches)."""
    exec(compile("import warnings\nwarnings.warn('old', CATEGORY, stacklevel=1)", f"<{module}>", "exec"),
         {"__name__": module, "CATEGORY": category})


def test_the_librarys_own_deprecations_are_errors_in_the_suite():
    """pyproject.toml's ``filterwarnings``: a FutureWarning or DeprecationWarning attributed to a
    module of hp_functional fails the test; one of torch's, transformers' or a test's own, or a
    module that only starts with the package's name, does not."""
    for category in (FutureWarning, DeprecationWarning):
        for module in ("hp_functional", "hp_functional.runtime.rng"):
            with pytest.raises(category, match="old"):
                _warn_from(module, category)
        for module in ("torch.distributed.distributed_c10d", "transformers.modeling_utils", "tests.cli.test_cli",
                       "hp_functional_plugin"):
            with pytest.warns(category, match="old"):  # recorded as a warning, not raised
                _warn_from(module, category)


@needs_make
def test_make_demo_and_test_set_up_then_run(tmp_path):
    venv = tmp_path / "venv"
    plan = _make("-n", "demo", f"VENV={venv}", "TORCH_INDEX=https://download.pytorch.org/whl/cpu").stdout
    lines = [ln for ln in plan.splitlines() if not ln.startswith("make")]
    assert f'test -x "{venv}/bin/python" || python3 -m venv "{venv}"' in lines
    torch_line = next(ln for ln in lines if '"torch==2.13.0"' in ln)
    assert "--index-url \"https://download.pytorch.org/whl/cpu\"" in torch_line
    assert sum("--index-url" in ln for ln in lines) == 1  # the torch install only
    assert any('-m pip install -e ".[test]"' in ln for ln in lines)
    assert lines.index(torch_line) < next(i for i, ln in enumerate(lines) if ".[test]" in ln)
    assert lines[-1].endswith(f'"{venv}/bin/hp-functional" demo')
    assert "--index-url" not in _make("-n", "demo", f"VENV={venv}").stdout  # plain pip by default
    test_plan = _make("-n", "test", f"VENV={venv}").stdout
    assert f'"{venv}/bin/python" -m pytest tests' in test_plan and "rc -eq 5" in test_plan


@needs_make
def test_make_set_up_is_a_stamp_check_once_done(tmp_path):
    venv = tmp_path / "venv"
    touch = next(ln for ln in _make("-n", "setup", f"VENV={venv}").stdout.splitlines() if ln.startswith("touch"))
    stamp = Path(touch.split('"')[1])
    assert stamp.parent == venv and stamp.name.startswith(".hpf-setup-")
    assert _make("-q", "setup", f"VENV={venv}").returncode == 1  # not set up yet
    venv.mkdir()
    stamp.touch()
    assert _make("-q", "setup", f"VENV={venv}").returncode == 0  # set up: nothing to do
    res = _make("demo", f"VENV={venv}", "-n")
    assert "pip install" not in res.stdout and "hp-functional\" demo" in res.stdout
    # another torch pin (or another pyproject.toml) is another stamp: set up again
    assert _make("-q", "setup", f"VENV={venv}", "TORCH=torch==2.99.0").returncode == 1


@needs_make
def test_make_test_newest_sets_up_its_own_venv_then_runs_the_fast_subset(tmp_path):
    venv = tmp_path / "venv-newest"
    lines = _make("-n", "test-newest", f"NEWEST_VENV={venv}").stdout.splitlines()
    torch_line = next(ln for ln in lines if "pip install" in ln and '"torch==2.14.1"' in ln)
    project_line = next(ln for ln in lines if '-e ".[test]"' in ln)
    assert f'-c "{venv}/torch-pin.txt"' in project_line and lines.index(torch_line) < lines.index(project_line)
    assert f'echo "torch==2.14.1" > "{venv}/torch-pin.txt"' in lines
    assert any(f'"{venv}/bin/python" -m pytest tests -m "not slow"' in ln for ln in lines)
    stamp = Path(next(ln for ln in lines if ln.startswith("touch")).split('"')[1])
    assert stamp.parent == venv and stamp.name.startswith(".hpf-setup-")
    venv.mkdir()
    stamp.touch()
    assert _make("-q", "setup-newest", f"NEWEST_VENV={venv}").returncode == 0  # set up: nothing to do
    assert "pip install" not in _make("-n", "test-newest", f"NEWEST_VENV={venv}").stdout
    assert _make("-q", "setup-newest", f"NEWEST_VENV={venv}", "NEWEST_TORCH=torch==2.99.0").returncode == 1


def test_ci_runs_exactly_make_demo_make_test_and_make_test_newest():
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [ln.strip() for ln in script if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "make demo", "make test", "make test-newest"]


def test_under_torchrun_reads_torchruns_environment(monkeypatch):
    from hp_functional.cli.launch import under_torchrun

    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not under_torchrun()
