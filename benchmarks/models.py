"""The support table: every model type with a PyTorch model in the installed transformers (675 in
5.25), each with its main head, tiny, at tp 2 (and tp 4 where the heads allow), against the
unsharded model; writes ``docs/models.md``.

    python benchmarks/models.py --jobs 2               # the whole table (every type, tp 2 then tp 4)
    python benchmarks/models.py --only opt,gpt2        # a few families (a reproduction), table not written
    python benchmarks/models.py --category vision --tp 2 --json out.json
    python benchmarks/models.py --build-only           # no sharding: which tiny models build and run

Each family runs in a process group of its own (gloo on CPU, ``tp`` ranks spawned once per world
size and reused: a process start with transformers imported costs seconds), with a timeout: a
family that outlives it is a ``hang`` and its ranks are killed and respawned.  The per-rank check
is ``hp_functional.tools.sweep.check_family`` (the suite's ``tests/models/test_model_sweep.py`` runs the
same function); heads and categories are ``hp_functional.tools.sweep_tasks``, inputs and losses
``hp_functional.tools.sweep_inputs``.  Families outside transformers come from
``hp_functional.tools.sweep_extras.EXTRA_FAMILIES`` where that module exists (see
``hp_functional/tools/sweep.py``'s docstring); ``--no-extras`` leaves them out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import queue
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hp_functional.tools.sweep import CRASH, EXACT, HANG, LITTLE, OUTCOMES, UNBUILDABLE, UNPROVED, WRONG, combine, heads_allow  # noqa: E402

#: a row meets the goal where it is exact and no rank holds this share of the parameters or more.
GOAL_SHARE = 0.65


def extra_families() -> dict:
    """``{name: builder}`` of the families outside transformers, from
    ``hp_functional.tools.sweep_extras`` where that module exists (its ``extra_families()``, else
    its ``EXTRA_FAMILIES``), else none."""
    import importlib

    try:
        module = importlib.import_module("hp_functional.tools.sweep_extras")
    except ModuleNotFoundError as exc:
        if exc.name != "hp_functional.tools.sweep_extras":
            raise
        return {}
    found = getattr(module, "extra_families", None)
    return dict(found() if callable(found) else getattr(module, "EXTRA_FAMILIES", {}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the memory one rank of the sharded sweep may allocate (ranks of 2 families at tp 4 fit in 24 GiB).
RANK_MEMORY_GB = 2


def _worker(rank: int, world: int, pg_timeout: float, inbox, outbox) -> None:
    """One rank: for each family a fresh gloo process group, ``check_family``, then destroyed."""
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from hp_functional.tools.sweep import CRASH, check_extra, check_family, first_line

    extras = extra_families()

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    # a tiny config whose defaults stay huge (ColPali's) fails to allocate (not buildable tiny) instead of waking
    # the OOM killer, which takes the rank and whatever else runs on the machine
    resource.setrlimit(resource.RLIMIT_DATA, (RANK_MEMORY_GB * 2 ** 30, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    outbox.put((rank, "ready"))  # imports done: the per-family timeout starts from here
    while (job := inbox.get()) is not None:
        port, model_type, functional = job
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=pg_timeout))
        except Exception as exc:  # noqa: BLE001 - e.g. a port taken meanwhile: the parent restarts and retries
            outbox.put((rank, {"init_failed": first_line(exc)}))
            return
        try:
            if model_type in extras:
                row = check_extra(model_type, extras[model_type], functional=functional)
            else:
                row = check_family(model_type, functional=functional)
        except BaseException as exc:  # noqa: BLE001 - reported as the family's row
            row = {"model_type": model_type, "tp": world, "plan": "", "outcome": CRASH, "reason": first_line(exc)}
        finally:
            dist.destroy_process_group()
        outbox.put((rank, row))


class Ranks:
    """``world`` spawned ranks that run one family at a time, each in a new process group."""

    def __init__(self, world: int, timeout: float):
        self.world, self.timeout = world, timeout
        self.ctx = mp.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.ready = False
        self.outbox = self.ctx.Queue()
        self.inboxes = [self.ctx.Queue() for _ in range(self.world)]
        pg_timeout = max(10.0, self.timeout * 0.6)
        self.procs = [self.ctx.Process(target=_worker, args=(r, self.world, pg_timeout, self.inboxes[r], self.outbox),
                                       daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def _wait_ready(self) -> None:
        ready = 0
        while ready < self.world:
            rank, msg = self.outbox.get(timeout=900)
            ready += msg == "ready"

    def run(self, model_type: str, functional: bool) -> dict:
        """The family's row; a process group that could not form (a port taken by another process
        meanwhile) is retried once on fresh ranks."""
        row = self._run(model_type, functional)
        if "init_failed" in row:
            self.restart()
            row = self._run(model_type, functional)
        if "init_failed" in row:
            self.restart()
            row = {"model_type": model_type, "tp": self.world, "plan": "", "outcome": "crash",
                   "reason": f"the process group did not form twice: {row['init_failed']}"}
        return row

    def _run(self, model_type: str, functional: bool) -> dict:
        if not self.ready:
            self._wait_ready()
            self.ready = True
        port = _free_port()
        for box in self.inboxes:
            box.put((port, model_type, functional))
        rows: dict[int, dict] = {}
        deadline = time.monotonic() + self.timeout
        while len(rows) < self.world:
            try:
                rank, row = self.outbox.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                if "init_failed" in row:
                    return row
                rows[rank] = row
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if time.monotonic() < deadline and not dead:
                    continue
                codes = [self.procs[r].exitcode for r in dead]
                self.restart()
                why = f"rank(s) {dead} died (exit codes {codes})" if dead else f"no result after {self.timeout:.0f} s"
                return {"model_type": model_type, "tp": self.world, "plan": "", "outcome": HANG if not dead else "crash",
                        "reason": f"{why}; ranks done: {sorted(rows)}"}
        return combine([rows[r] for r in range(self.world)])

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def model_types() -> list[str]:
    """Every model type with a PyTorch model in the installed transformers (``sweep_tasks.model_types``)."""
    from hp_functional.tools.sweep_tasks import model_types as all_types

    return all_types()


def category(name: str, extras: dict) -> str:
    """The row's category (an extra family's is known once built: ``other`` until then)."""
    from hp_functional.tools.sweep_tasks import category_of

    return "other" if name in extras else category_of(name)


def head(name: str, extras: dict) -> str:
    from hp_functional.tools.sweep_tasks import task_for

    try:
        return "extra" if name in extras else task_for(name).name
    except KeyError:
        return ""


def sweep(types: list[str], tps: list[int], timeout: float, functional: bool, jobs: int = 1,
          log=print, checkpoint: Path | None = None, base: dict | None = None,
          label: str | None = None) -> dict[str, dict[int, dict]]:
    """``{model type: {tp: row}}`` in ``types`` order; tp > 2 runs only where tp 2 built and the
    heads divide.  ``jobs``: families run at the same time (each job its own ranks).  ``checkpoint``:
    a JSON file rewritten with the rows so far after each type (an interrupted run keeps them), laid
    over ``base`` (the table an ``--update`` merges into: the file never holds less than it), each new row
    labelled ``run``: ``label`` where given."""
    lock = threading.Lock()
    todo: queue.Queue = queue.Queue()
    for i, t in enumerate(types):
        todo.put((i, t))
    table: dict[str, dict[int, dict]] = {t: {} for t in types}
    extras = extra_families()

    def work() -> None:
        pools = {tp: Ranks(tp, timeout) for tp in tps}
        try:
            while True:
                try:
                    i, t = todo.get_nowait()
                except queue.Empty:
                    return
                for tp in tps:
                    built = all(r["outcome"] != "not buildable tiny" for r in table[t].values())
                    if tp != min(tps) and not (built and (t in extras or heads_allow(t, tp))):
                        continue
                    row = table[t][tp] = pools[tp].run(t, functional)
                    if "category" not in row:  # a hang or a dead rank: the parent names it
                        row.update(category=category(t, extras), task=head(t, extras))
                    if label:
                        row["run"] = label
                    log(f"[{i + 1}/{len(types)}] {t:28s} tp {tp}: {row['outcome']:20s} {row.get('task', ''):22s} "
                        f"{row.get('plan', ''):9s} "
                        f"{row['reason'][:110]}  ({row.get('seconds', 0):.1f} s)", flush=True)
                if checkpoint is not None:
                    with lock:
                        done = {k: v for k, v in table.items() if v}
                        checkpoint.write_text(json.dumps({**(base or {}), **done}, indent=1, default=str))
        finally:
            for p in pools.values():
                p.close()

    threads = [threading.Thread(target=work) for _ in range(max(1, jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return table


def counts(table: dict[str, dict[int, dict]], tp: int, cat: str | None = None) -> Counter:
    return Counter(rows[tp]["outcome"] for rows in table.values()
                   if tp in rows and (cat is None or rows[tp].get("category") == cat))


def _category_of_row(rows: dict[int, dict]) -> str:
    return next((r["category"] for r in rows.values() if r.get("category")), "")


def goal(table: dict[str, dict[int, dict]], tp: int, cat: str | None = None) -> tuple[int, int]:
    """(types exact at ``tp`` with every rank below ``GOAL_SHARE`` of the parameters, every type):
    over **all** types (of ``cat``), a type not buildable or not run at ``tp`` counting as missed."""
    types = [rows for rows in table.values() if cat is None or _category_of_row(rows) == cat]
    met = [rows for rows in types
           if tp in rows and rows[tp]["outcome"] == EXACT and (rows[tp].get("share") or 1.0) < GOAL_SHARE]
    return len(met), len(types)


def proofs(table: dict[str, dict[int, dict]], tp: int) -> tuple[Counter, int]:
    """(how the exact rows at ``tp`` were proved: ``{label: rows}``, the rows that ran — exact, sharded
    little or wrong — with no proof: must be 0)."""
    ran = [rows[tp] for rows in table.values() if tp in rows and rows[tp]["outcome"] in (EXACT, LITTLE, WRONG)]
    by = Counter(r.get("proof") or UNPROVED for r in ran if r["outcome"] == EXACT)
    unproved = sum(1 for r in ran if (r.get("proof") or UNPROVED) == UNPROVED)
    return by, unproved


def _pct(met: int, of: int) -> str:
    return f"{met}/{of} ({100 * met / of:.0f} %)" if of else "–"


#: what a user can expect, by kind of model (docs/auto-plan.md has the rules behind it).
EXPECT = [
    "## What to expect, by kind of model",
    "",
    "- **Decoder LMs** with an HF `tp_plan`: HF's plan, entry for entry; `auto_plan` plans what it leaves out "
    "(nothing, for most). Without one: `auto_plan` by dataflow (GPT-2's `Conv1D`, OPT, BLOOM). Mixtures of experts "
    "are found from their routing; experts HF's plan leaves whole are planned expert parallel over the axis "
    "(`hpf.Experts`) where they are fused or take the routing. Where `shard()` refuses what `auto_plan` added to "
    "HF's plan, the row runs HF's plan alone (the `plan` column says `from_hf`), as a user would.",
    "- **Encoders** (BERT, RoBERTa, DeBERTa-v2, ELECTRA, ModernBERT): attention and MLP pairs are found across sibling "
    "modules (`attention.self` → `attention.output`); masked-LM heads are vocab-sharded with their tied bias.",
    "- **Encoder-decoders** (T5, BART, mBART, Marian, Whisper): one embedding table for encoder, decoder and head; "
    "cross-attention planned like self-attention; T5's relative position bias sharded by head.",
    "- **Vision** (ViT, DeiT, BEiT, Swin, ConvNeXt) and **speech** (Whisper, wav2vec2, HuBERT): convolutions "
    "(patch embeddings, feature encoders) and classifiers stay replicated and `plan.coverage` says so; a tiny "
    "model made mostly of them shards little. **ConvNets** (half their parameters or more in convolutions: "
    "ResNet, RegNet, MobileNet, PoolFormer) are planned with `auto_plan(..., split_convolutions=True)`, as a user "
    "who wants their channels split asks (the `plan` column says so).",
    "- **Dual encoders** (CLIP, SigLIP): both towers sharded, the projections and `logit_scale` replicated, their "
    "contrastive loss exact.",
    "- **Vision-language and audio-language models**: the text model by HF's plan and the vision or audio tower "
    "and projector by `auto_plan` (`auto_plan(..., base=ShardingPlan.from_hf(model))`), traced on real images "
    "(tiles, patch grids, packed patches, as each model takes them) or audio; the few types whose media inputs the "
    "sweep cannot build run on text only (the `inputs` of their row say which).",
    "- **Diffusion transformers and timm** (optional extras): [diffusion and timm](diffusion-and-timm.md).",
    "- **Refused** rows name the module and the fix. **Not buildable tiny** rows say why: a library the type "
    "needs that is not installed here (timm, PIL, natten, detectron2, torchaudio), a model with no forward over a "
    "batch of tensors (video tracking sessions, generation-only composites: `sweep_tasks.NOT_TINY`), or the sweep's "
    "own limits (a tiny config or input the type's own validation or modeling code rejects), not the library's.",
]


def write_markdown(table: dict[str, dict[int, dict]], tps: list[int], path: Path, seconds: float) -> None:
    """``docs/models.md``: versions, the goal metric, counts overall and per category, one row per type."""
    from hp_functional.tools.sweep_tasks import CATEGORIES

    found = {r.get("category") for rows in table.values() for r in rows.values()} - {None, ""}
    cats = [c for c in CATEGORIES if c in found] + sorted(found - set(CATEGORIES))  # extras may bring their own
    lines = [*_header(table, tps, seconds), *_count_lines(table, tps, cats), "", *EXPECT]
    lines += ["", "Reproduce one type: `python benchmarks/models.py --only <model type>`.", "",
              "| model type | category | head | " + " | ".join(f"tp {tp}" for tp in tps) + " | plan | proof | reason |",
              "|---|---|---|" + "---|" * len(tps) + "---|---|---|"]
    lines += [_type_line(t, rows, tps) for t, rows in table.items()]
    path.write_text("\n".join(lines) + "\n")


def _provenance(table: dict[str, dict[int, dict]], seconds: float) -> str:
    """Which run each row comes from: one full run, or a full run with rows rerun by ``--update``
    (each rerun's label, ``row["run"]``, and its types: consecutive ones in the table as ``first … last``);
    the types no run reached (no row), where there are any."""
    reruns: dict[str, list[list[str]]] = {}
    previous = None
    for t, rows in table.items():
        label = next((r["run"] for r in rows.values() if r.get("run")), None) if rows else "never run"
        if label is not None:
            spans = reruns.setdefault(label, [])
            if previous == label:
                spans[-1].append(t)
            else:
                spans.append([t])
        previous = label
    missed = reruns.pop("never run", [])
    if not reruns and not missed:
        return (f"{seconds / 60:.0f} min on this machine." if seconds else
                "an earlier full run (`--json`) with rows rerun and merged by `--update`.")
    text = "an earlier full run (`--json`)" + ("; every row comes from it except these, rerun on the code of the time "
                                             "and merged by `--update`: " if reruns else ".") + "; ".join(
        f"{label}: {_spans(spans)}" for label, spans in reruns.items()) + ("." if reruns else "")
    return text + (f" **Not run** (no run reached them: `–` in every column, counted as missed): {_spans(missed)}."
                   if missed else "")


def _spans(spans: list[list[str]]) -> str:
    """``N types (a, b … c (k in a row))``: runs of consecutive types."""
    return f"{sum(map(len, spans))} types (" + ", ".join(
        s[0] if len(s) == 1 else f"{s[0]} … {s[-1]} ({len(s)} in a row)" for s in spans) + ")"


def _header(table: dict[str, dict[int, dict]], tps: list[int], seconds: float) -> list[str]:
    """The table's title, how it was made, the outcomes, the goal and proof lines."""
    import torch
    import transformers

    return [
        "# Support table: every model type of transformers",
        "",
        f"Generated by `python benchmarks/models.py` on {datetime.date.today().isoformat()}: transformers "
        f"{transformers.__version__}, torch {torch.__version__}, {len(table)} model types (every type with a "
        "PyTorch model: `MODEL_MAPPING_NAMES` and every head mapping of `transformers.models.auto.modeling_auto`, "
        "plus the extra families of `hp_functional.tools.sweep_extras`"
        + ("" if any(r.get("task") == "extra" for rows in table.values() for r in rows.values()) else
           ": none in this run, neither diffusers nor timm being installed") + "), CPU gloo ranks, "
        + _provenance(table, seconds),
        "",
        "Each type: its main head (`hp_functional.tools.sweep_tasks.task_for`: causal LM where it has one (an "
        "encoder-decoder's seq2seq head first), then "
        "seq2seq LM, masked LM, image-text-to-text, multimodal LM, speech seq2seq, the contrastive base model "
        "(CLIP, SigLIP: `return_loss=True`), image classification, CTC, audio classification, sequence "
        "classification, else the bare base model), a tiny config from "
        "`hp_functional.tools.model_configs.tiny_config_for` (hidden 64, 4 heads of 16, 2 KV heads at tp 2 and 4 "
        "at tp 4, vocabulary 128 (and label vocabularies), position tables of at most 64 rows (grids of 64 × 64 "
        "pixels), 2 to 4 layers, 4 experts, images 32 × 32 in patches of 8, a 2-layer audio "
        "feature extractor, 3 labels; nested configs, backbones, necks and codecs shrunk alike; per-type fixes in "
        "`model_configs.FAMILY`), eager attention, random weights, inputs built from the config "
        "(`hp_functional.tools.sweep_inputs`: batch 2 × 8 tokens, pixels, 400 audio samples or mel features, "
        "labels; what no modality builds — time series, trajectories, prompts — per type in `EXTRA_INPUTS`); "
        "the loss is the model's own, else the mean square of its main output. The plan is "
        "`hpf.auto_plan(model, mesh, example_inputs=inputs, base=ShardingPlan.from_hf(model))` where HF "
        "declares a TP plan (HF's entries kept, what they leave out planned by dataflow; `from_hf` alone where "
        "auto_plan refuses the rest) and `hpf.auto_plan(model, mesh, example_inputs=inputs)` otherwise "
        "(`hp_functional.tools.sweep.plan_for`); where `shard()` refuses that plan, the next a user would try: "
        "HF's alone, then `auto_plan` alone (`plans_in_turn`); `shard()` on a 1-D `tp` mesh, the loss and every "
        "gradient (`.backward()` and `torch.func.grad`, gathered with `hpf.unshard`) against the unsharded model "
        "in the same process (`hp_functional.tools.sweep.check_family`); a row whose float32 difference exceeds "
        "1e-5 is rerun in float64 and judged there (1e-9: a loss that amplifies rounding, CTC's or a "
        "contrastive temperature's, is exact there; a wrong plan is not). Every forward starts from torch's "
        "global generator seeded alike (a model that draws from it). tp 4 runs where tp 2 built and the heads "
        "divide by 4.",
        "",
        "Outcomes: **exact** (within 1e-5 and a rank holds < 80 % of the parameters); **ran, sharded little** "
        "(exact, but a rank holds ≥ 80 %); **refused** (the library's own error, first line); **crash** (any "
        "other exception, with the site); **wrong** (numbers differ: largest loss/gradient difference); "
        "**hang** (timeout); **not buildable tiny** (the tiny config or the unsharded model failed, or a rank ran over "
        "the sweep's per-rank memory cap).",
        "",
        f"Goal: of **all** types (one not buildable, or not run at a tp, counts as missed), exact with no rank "
        f"holding {GOAL_SHARE:.0%} or more of the parameters: "
        + "; ".join(f"tp {tp}: **{_pct(*goal(table, tp))}**" for tp in tps) + ".",
        "",
        "Proof (`apply_fn.runtime.checks[\"proof\"]`, [the proof obligation](guarantees.md#the-proof-obligation): "
        "`shard()` accepts a plan only where the probe compared the loss and every gradient on its reduced copy, or "
        "the dataflow pass traced the forward with no planned module running a function of its own; the `proof` "
        "column says which: `both`, `probe`, `dataflow`): "
        + "; ".join(f"tp {tp}: " + ", ".join(f"{label} {n}" for label, n in proofs(table, tp)[0].most_common())
                    + f" of the exact rows, **{proofs(table, tp)[1]} unproved**" for tp in tps)
        + " (a row that ran with no proof would be a crash: shard()'s obligation broken).",
        "",
    ]


def _count_lines(table: dict[str, dict[int, dict]], tps: list[int], cats: list[str]) -> list[str]:
    """The outcome counts per tp, then per category with each category's goal."""
    lines = ["| outcome | " + " | ".join(f"tp {tp}" for tp in tps) + " |", "|---|" + "---:|" * len(tps)]
    per_tp = {tp: counts(table, tp) for tp in tps}
    for outcome in reversed(OUTCOMES):
        lines.append(f"| {outcome} | " + " | ".join(str(per_tp[tp].get(outcome, 0)) for tp in tps) + " |")
    lines.append("| total | " + " | ".join(str(sum(per_tp[tp].values())) for tp in tps) + " |")
    tp_label = " / ".join(f"tp {tp}" for tp in tps)
    lines += ["", f"Per category ({tp_label}):", "",
              "| category | types | " + " | ".join(reversed(OUTCOMES)) + " | goal |",
              "|---|---:|" + "---:|" * len(OUTCOMES) + "---|"]
    for cat in cats:
        n = sum(1 for rows in table.values() if any(r.get("category") == cat for r in rows.values()))
        per = {tp: counts(table, tp, cat) for tp in tps}
        cells = [" / ".join(str(per[tp].get(o, 0)) for tp in tps) for o in reversed(OUTCOMES)]
        lines.append(f"| {cat} | {n} | " + " | ".join(cells) + " | "
                     + " ; ".join(_pct(*goal(table, tp, cat)) for tp in tps) + " |")
    return lines


def _type_line(t: str, rows: dict[int, dict], tps: list[int]) -> str:
    """One type's row: its outcome per tp, plan, proof (per tp where they differ) and reasons."""
    cells = [rows[tp]["outcome"] if tp in rows else "–" for tp in tps]
    plan = next((r["plan"] for r in rows.values() if r.get("plan")), "")
    cat = next((r["category"] for r in rows.values() if r.get("category")), "")
    task = next((r["task"] for r in rows.values() if r.get("task")), "")
    reasons = []
    for tp in tps:
        if tp in rows and rows[tp]["reason"] and rows[tp]["reason"] not in reasons:
            reasons.append(rows[tp]["reason"] if not reasons else f"tp {tp}: {rows[tp]['reason']}")
    reason = " ; ".join(reasons).replace("|", "\\|").replace("\n", " ")
    proved = [rows[tp].get("proof") or "" for tp in tps if tp in rows and rows[tp]["outcome"] in (EXACT, LITTLE, WRONG)]
    proof = " / ".join(proved) if len(set(proved)) > 1 else proved[0] if proved else ""
    return f"| {t} | {cat} | {task} | " + " | ".join(cells) + f" | {plan} | {proof} | {reason} |"


def build_only(types: list[str], timeout: float, memory_gb: float = 8.0, log=print) -> dict[str, dict[int, dict]]:
    """``{model type: {2: row}}`` without sharding, in this process: whether each tiny model builds
    and runs forward and backward (``sweep.build_only``); a type that takes longer than ``timeout``
    (an alarm) or more than ``memory_gb`` of memory is not buildable."""
    import resource
    import signal

    import torch
    from transformers.utils import logging as hf_logging

    from hp_functional.tools.sweep import build_only as build_row

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    if memory_gb:  # a model whose defaults stay huge fails to allocate instead of waking the OOM killer
        resource.setrlimit(resource.RLIMIT_DATA, (int(memory_gb * 2 ** 30), resource.getrlimit(resource.RLIMIT_DATA)[1]))

    def alarm(*_):
        raise TimeoutError(f"building took more than {timeout:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    table = {}
    try:
        for i, t in enumerate(types):
            signal.alarm(max(1, int(timeout)))
            try:
                row = build_row(t)
            except (TimeoutError, MemoryError) as exc:
                row = {"model_type": t, "tp": 2, "outcome": UNBUILDABLE, "reason": f"{type(exc).__name__}: {exc}"[:200],
                       "plan": ""}
            finally:
                signal.alarm(0)
            table[t] = {2: row}
            log(f"[{i + 1}/{len(types)}] {t:28s} {row.get('category', ''):15s} {row.get('task', ''):22s} "
                f"{row['outcome']:18s} {row.get('inputs', '')[:50]:50s} {row['reason'][:110]} "
                f"({row.get('seconds', 0):.1f} s)", flush=True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return table


def update(path: Path, only: list[str], tps: list[int], args, order: list[str]) -> dict[str, dict[int, dict]]:
    """A full run's table (``path``, its ``--json``) with ``only``'s types (default: its crashes, hangs
    and wrong rows) rerun and merged in, each rerun row labelled ``run`` (the table's header names
    them), in the full ``order``; the checkpoint (``args.json``) holds the merged table throughout."""
    table = {t: {int(tp): row for tp, row in rows.items()} for t, rows in json.loads(path.read_text()).items()}
    redo = only or [t for t, rows in table.items() if any(r["outcome"] in (CRASH, HANG, WRONG) for r in rows.values())]
    print(f"rerunning {len(redo)}: {', '.join(redo)}")
    label = f"rerun of {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    rerun = sweep(redo, tps, args.timeout, not args.no_func_grad, args.jobs,
                  checkpoint=Path(args.json) if args.json else None, base=table, label=label)
    index = {t: i for i, t in enumerate(order)}
    missing = {t: {} for t in order if t not in table and t not in rerun}  # never run: shown, counted as missed
    return dict(sorted({**missing, **table, **rerun}.items(), key=lambda kv: index.get(kv[0], len(index))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all); the table is not written")
    ap.add_argument("--category", default="", help="comma-separated categories (decoder LM, encoder, vision, ...); "
                                                    "the table is not written")
    ap.add_argument("--tp", default="2,4", help="world sizes (default 2,4)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per family and tp before it is a hang")
    ap.add_argument("--no-func-grad", action="store_true", help="check .backward() only, not torch.func.grad")
    ap.add_argument("--no-extras", action="store_true", help="leave out the families of sweep_extras")
    ap.add_argument("--build-only", action="store_true",
                    help="no sharding: build each tiny model and run it unsharded (counts 'not buildable tiny')")
    ap.add_argument("--out", default=str(ROOT / "docs" / "models.md"), help="the markdown table to write")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    ap.add_argument("--update", default="",
                    help="a full run's --json: rerun --only's types (default: its crashes, hangs and wrong rows), merge "
                         "them in and write the table")
    ap.add_argument("--jobs", type=int, default=1, help="families at the same time (default 1; 2 on 2 cores)")
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",")]
    extras = {} if args.no_extras else extra_families()
    types = [t for t in args.only.split(",") if t] or model_types() + sorted(extras)
    if args.category:
        wanted = {c.strip() for c in args.category.split(",")}
        types = [t for t in types if category(t, extras) in wanted]
    t0 = time.perf_counter()
    if args.build_only:
        table = build_only([t for t in types if t not in extras], args.timeout)
        tps = [2]
        c = Counter(rows[2]["outcome"] for rows in table.values())
        print(f"built {c.get('built', 0)}, {UNBUILDABLE} {c.get(UNBUILDABLE, 0)} (of {len(table)}); "
              + ", ".join(f"{cat} {n}" for cat, n in Counter(r[2].get("category", "") for r in table.values()
                                                             if r[2]["outcome"] == UNBUILDABLE).most_common()))
    elif args.update:
        table = update(Path(args.update), [t for t in args.only.split(",") if t], tps, args, model_types() + sorted(extras))
        args.only = args.category = ""  # the merged table is a full one
    else:
        table = sweep(types, tps, args.timeout, not args.no_func_grad, args.jobs,
                      checkpoint=Path(args.json) if args.json else None)
        for tp in tps:
            c = counts(table, tp)
            print(f"tp {tp}: " + ", ".join(f"{o} {c[o]}" for o in reversed(OUTCOMES) if c.get(o))
                  + f" (of {sum(c.values())}); goal {_pct(*goal(table, tp))}")
    seconds = time.perf_counter() - t0
    print(f"{seconds / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, default=str))
    if not (args.only or args.category or args.build_only):
        write_markdown(table, tps, Path(args.out), 0.0 if args.update else seconds)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
