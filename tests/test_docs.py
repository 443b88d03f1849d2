"""The docs run as written: the README's example under torchrun on 2 gloo ranks, every block
marked ``<!-- runnable -->`` in README.md and docs/*.md (in one fresh process, each block in its
own folder and namespace), the README's size, every relative link (and its #anchor), and the layer
order the package's docstrings and docs/architecture.md give (``tests/test_layers.py``'s)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, language, marker comment before it or "", code) per fenced block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = lines[i - 1].strip() if i and lines[i - 1].strip().startswith("<!--") else ""
        out.append((i + 1, m.group(1), marker, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return out


def readme_example() -> str:
    """The block marked ``<!-- example -->``, else the README's one python block."""
    found = [b for b in blocks(README) if b[2] == "<!-- example -->"]
    if not found:
        found = [b for b in blocks(README) if b[1] == "python"]
        assert len(found) == 1, "README.md: mark its example with <!-- example --> (it has several python blocks)"
    return found[0][3]


RUNNABLE = [(p, line, code) for p in PAGES for line, lang, marker, code in blocks(p) if marker == "<!-- runnable -->"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.slow
def test_readme_example_runs_under_torchrun(tmp_path, request):
    if any(item.path == request.path and item.originalname == "test_runnable_block" for item in request.session.items):
        request.getfixturevalue("blocks_run")  # the blocks' process starts first: its start-up overlaps this one's
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    loss = re.search(r"^loss (\S+) unsharded (\S+) \|diff\| (\S+)$", run.stdout, re.M)
    grad = re.search(r"^max \|grad diff\| (\S+) over (\d+) parameters$", run.stdout, re.M)
    assert loss and grad, run.stdout[-4000:]
    assert float(loss.group(3)) < 1e-5 and abs(float(loss.group(1)) - float(loss.group(2))) < 1e-5, loss.group(0)
    assert float(grad.group(1)) < 1e-5 and int(grad.group(2)) > 0, grad.group(0)
    assert len(re.findall(r"^loss ", run.stdout, re.M)) == 1, "only rank 0 prints"
    assert "communication schedule" in run.stdout and "memory per rank" in run.stdout  # explain's report


def test_there_are_runnable_blocks():
    pages = {p.name for p, _, _ in RUNNABLE}
    assert {"plan-language.md", "tools.md", "guarantees.md"} <= pages, pages


#: runs each block file given on the command line as ``__main__``, in its own folder and namespace,
#: and writes {index: None or the traceback} as JSON (one interpreter for every block: torch and
#: transformers are imported once, not once per block)
_RUN_BLOCKS = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for i, path in enumerate(sys.argv[2:]):
    os.chdir(os.path.dirname(path))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        results[i] = None
    except BaseException:  # SystemExit too: a block must run to its end
        results[i] = out.getvalue()[-2000:] + traceback.format_exc()[-3000:]
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def blocks_run(tmp_path_factory):
    """Every runnable block run in one fresh process, each in its own empty folder: started here,
    waited for by ``block_results``."""
    root = tmp_path_factory.mktemp("blocks")
    paths = []
    for i, (_, _, code) in enumerate(RUNNABLE):
        (root / f"b{i}").mkdir()
        paths.append(root / f"b{i}" / "block.py")
        paths[-1].write_text(code)
    (root / "run.py").write_text(_RUN_BLOCKS)
    cmd = [sys.executable, str(root / "run.py"), str(root / "results.json"), *map(str, paths)]
    with open(root / "stdout.txt", "w") as out, open(root / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=root, env=_env())
    yield proc, root
    if proc.poll() is None:  # not waited for (a failure before block_results)
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def block_results(blocks_run) -> dict[str, str | None]:
    """``blocks_run``'s results: {index: None or the traceback}."""
    import json

    proc, root = blocks_run
    proc.wait(timeout=600)
    out, err = (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text()
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("index", range(len(RUNNABLE)), ids=[f"{p.name}:{line}" for p, line, _ in RUNNABLE])
@pytest.mark.slow
def test_runnable_block(block_results, index):
    path, line, _ = RUNNABLE[index]
    assert block_results[str(index)] is None, f"{path.name}:{line}\n{block_results[str(index)]}"


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; move detail to docs/"


def test_docstrings_and_the_architecture_page_give_the_layers_in_the_tests_order():
    """One layer order, ``tests/test_layers.py``'s ``LAYERS``: each layer package's docstring says
    ``Layer N:`` with N its place there, the package root's docstring chains them in that order, and
    docs/architecture.md's diagram draws them from the top (cli) down to core."""
    from tests.test_layers import LAYERS

    package = ROOT / "hp_functional"

    def docstring(path: Path) -> str:
        return ast.get_docstring(ast.parse(path.read_text())) or ""

    numbered = {layer: re.match(r"(Layer \d+:)?", docstring(package / layer / "__init__.py")).group(1) for layer in LAYERS}
    assert numbered == {layer: f"Layer {n}:" for n, layer in enumerate(LAYERS, 1)}, numbered
    root = " ".join(docstring(package / "__init__.py").split())
    chain = re.search(r"``\w+``(?: → ``\w+``)+", root)
    assert chain and re.findall(r"``(\w+)``", chain.group(0)) == list(LAYERS), root
    diagram = next(code for _, _, _, code in blocks(ROOT / "docs" / "architecture.md") if "imports point down" in code)
    drawn = re.findall(r"^ *\| *(\w+)/ *\|", diagram, re.M)
    assert drawn[::-1] == list(LAYERS), drawn


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_point_to_existing_files(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # links inside code are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = path.parent / file if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to -)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
