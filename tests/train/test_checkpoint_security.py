"""Checkpoint security and integrity: loading executes nothing from disk (a pickle
payload as ``.metadata``, as ``extra`` or as a tensor record never runs: a marker file it would
create never appears), ``save``/``export_hf`` delete nothing they did not create, 16 flipped bytes
in a parameter, an AdamW moment or an exported safetensors tensor are named (file and tensor) on
every rank, a failing load is an ``hpf.CheckpointError`` (an ``Exception``) that never advises
``weights_only=False``, and an index cannot point outside its folder."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hp_functional as hpf
from tests.conftest import get_pool
from tests.support.helpers import build_hf, make_hf_state, mesh
from tests.support.models import MLP, PLANS, make_mlp_state

MARKER = "hpf_complete.json"


class _Payload:
    """Pickles as a call to ``eval`` that creates ``marker`` and then evaluates ``then``."""

    def __init__(self, marker: str, then: str = "None"):
        self.marker, self.then = marker, then

    def __reduce__(self):
        return eval, (f"(open({self.marker!r}, 'w').close(), {self.then})[1]",)


def _shard_mlp():
    model = MLP()
    model.load_state_dict(make_mlp_state())
    return hpf.shard(model, PLANS["tp"], mesh())


def _outcome(fn, *args, **kwargs) -> tuple[str, bool, str] | None:
    """None, or (type, is an Exception, message) of what ``fn`` raised (BaseException included)."""
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: caught to be reported
        return type(exc).__name__, isinstance(exc, Exception), str(exc)
    return None


# ---------------------------------------------------------------- editing a saved checkpoint as an attacker or a bad disk would
def _chunks(path: Path) -> dict:
    """(fqn, offset) -> (file, offset, length) from DCP's metadata (our own file, read unrestricted here)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    return {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
            for i, s in md.storage_data.items()}


def _rewrite(path: Path, file: str, offset: int, new: bytes, chunk: tuple | None = None) -> None:
    """Overwrite bytes of ``file`` and, when ``chunk`` is given, record the new content in the marker
    as a save would (its size, and its checksum where the marker has checksums)."""
    full = path / file
    data = bytearray(full.read_bytes())
    data[offset:offset + len(new)] = new
    full.write_bytes(bytes(data))
    if chunk is None:
        return
    import xxhash

    marker = json.loads((path / MARKER).read_text())
    marker["files"][file] = len(data)
    if "checksums" in marker:
        if file == ".metadata":
            marker["checksums"]["metadata"] = xxhash.xxh3_64_hexdigest(bytes(data))
        else:
            fqn, off, start, length = chunk
            for entry in marker["checksums"]["chunks"]:
                if entry[0] == fqn and (entry[1] is None if off is None else tuple(entry[1]) == off):
                    entry[2] = xxhash.xxh3_64_hexdigest(bytes(data[start:start + length]))
    (path / MARKER).write_text(json.dumps(marker))


def _data_middle(path: Path, file: str, start: int, length: int) -> int:
    """The file offset 8 bytes before the middle of a tensor chunk's raw data."""
    chunk = (path / file).read_bytes()[start:start + length]
    raw = torch.load(io.BytesIO(chunk), weights_only=True).contiguous().numpy().tobytes()
    pos = chunk.find(raw)
    assert pos >= 0 and len(raw) >= 32
    return start + pos + len(raw) // 2 - 8


def _flip16(path: Path, file: str, at: int) -> None:
    full = path / file
    old = full.read_bytes()[at:at + 16]
    _rewrite(path, file, at, bytes(b ^ 0x5A for b in old))


def _corrupt_copies(root: Path, markers: Path) -> dict[str, str]:
    """Copies of ``root/ok``, each spoiled one way; kind -> path."""
    ok, out = root / "ok", {}
    chunks = _chunks(ok)
    for kind in ("param", "moment", "record", "metadata", "extra"):
        out[kind] = str(root / kind)
        shutil.copytree(ok, out[kind])
    for kind, key in (("param", ("up.weight", (16, 0))), ("moment", ("optim/mu/up.weight", (0, 0)))):
        file, start, length = chunks[key]
        _flip16(Path(out[kind]), file, _data_middle(ok, file, start, length))  # size unchanged, checksums not
    # a tensor record whose pickle names builtins.eval, the marker's checksum made to agree
    file, start, length = chunks[("down.weight", (0, 16))]
    chunk = (ok / file).read_bytes()[start:start + length]
    old = b"torch._utils\n_rebuild_tensor_v2"
    new = b"builtins\neval" + b"x" * (len(old) - len(b"builtins\neval"))
    _rewrite(Path(out["record"]), file, start + chunk.index(old), new, ("down.weight", (0, 16), start, length))
    # .metadata: a pickle that runs code, then returns the real metadata (marker size and checksum updated)
    real = (ok / ".metadata").read_bytes()
    payload = pickle.dumps(_Payload(str(markers / "metadata"), f"__import__('pickle').loads({real!r})"), protocol=2)
    (Path(out["metadata"]) / ".metadata").write_bytes(b"")
    _rewrite(Path(out["metadata"]), ".metadata", 0, payload, ("", None, 0, len(payload)))
    # each rank's extra: a pickle payload of the same length (a pickle ignores what follows its STOP)
    for r in (0, 1):
        file, start, length = chunks[(f"extra/{r}", None)]
        payload = pickle.dumps(_Payload(str(markers / f"extra{r}")), protocol=2)
        assert len(payload) <= length, (len(payload), length)
        _rewrite(Path(out["extra"]), file, start, payload + b" " * (length - len(payload)), (f"extra/{r}", None, start, length))
    return out


# ---------------------------------------------------------------- the cases run on the ranks
def case_save(root: str) -> None:
    _, params, info = _shard_mlp()
    opt = hpf.optim.adamw(1e-2)
    g = torch.Generator().manual_seed(1)
    grads = {k: hpf.slice_local(torch.randn(i.global_shape, generator=g), i) for k, i in info.items()}
    params, state = opt.update(grads, opt.init(params), params)
    hpf.save(f"{root}/ok", params, info, opt_state=state, extra={"step": 1, "rank": dist.get_rank(), "note": "x" * 200,
                                                                 "rng": torch.get_rng_state(), "pair": (1.5, [None, True])})


def case_load(paths: dict[str, str]) -> dict:
    _, params, info = _shard_mlp()
    template = hpf.optim.adamw(1e-2).init(params)
    out = {kind: _outcome(hpf.load, path, info, opt_state=template) for kind, path in paths.items()}
    good = hpf.load(paths["ok"], info, opt_state=template)
    assert good.extra["pair"] == (1.5, [None, True]) and good.extra["rank"] == dist.get_rank(), good.extra
    assert good.extra["rng"].dtype == torch.uint8 and good.extra["rng"].shape == torch.get_rng_state().shape
    return out


def test_loading_runs_nothing_and_names_corrupt_tensors_on_every_rank(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    pool = get_pool(2)
    pool.run(case_save, str(tmp_path), timeout=120)
    paths = {"ok": str(tmp_path / "ok"), **_corrupt_copies(tmp_path, markers)}
    per_rank = pool.run(case_load, paths, timeout=120)
    assert sorted(os.listdir(markers)) == [], "code from the checkpoint ran"
    expect = {"param": [".distcp", "'up.weight'", "checksum"], "moment": [".distcp", "'optim/mu/up.weight'", "checksum"],
              "record": [".distcp", "'down.weight'", "not a plain tensor record"],
              "metadata": [".metadata", "eval", "refused"], "extra": ["extra", "not a valid encoding"]}
    for r, rows in enumerate(per_rank):
        assert rows.pop("ok") is None, rows
        for kind, parts in expect.items():
            assert rows[kind] is not None, f"rank {r}: {kind} loaded without an error"
            name, is_exception, msg = rows[kind]
            assert name == "CheckpointError" and is_exception, (r, kind, rows[kind])
            assert "weights_only" not in msg, (r, kind, msg)
            for part in parts:
                assert part in msg, (r, kind, part, msg)


def case_refuse_extra(root: str, marker: str) -> tuple | None:
    """Each rank alone (the other waits at a barrier): the refusal comes before any collective."""
    _, params, info = _shard_mlp()
    got = None
    for r in range(dist.get_world_size()):
        if dist.get_rank() == r:
            got = _outcome(hpf.save, f"{root}/x", params, info, extra={"step": 1, "bad": [{"hook": _Payload(marker)}]})
        dist.barrier()
    return got


def test_an_extra_that_needs_pickle_is_refused_at_save(tmp_path):
    marker = tmp_path / "ran"
    for got in get_pool(2).run(case_refuse_extra, str(tmp_path), str(marker), timeout=60):
        assert got is not None and got[0] == "CheckpointError" and "extra['bad'][0]['hook']" in got[2], got
    assert not marker.exists() and sorted(os.listdir(tmp_path)) == []


# ---------------------------------------------------------------- nothing deleted that we did not create
def _snapshot(paths: list[Path]) -> dict[str, bytes]:
    out = {}
    for p in paths:
        for f in ([p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())):
            out[str(f)] = f.read_bytes()
    return out


def case_user_files(root: str) -> dict:
    _, params, info = _shard_mlp()
    model = MLP()
    out = {"save_user_dir": _outcome(hpf.save, f"{root}/user", params, info),
           "export_user_dir": _outcome(hpf.export_hf, params, info, model, f"{root}/user")}
    for _ in range(2):  # a new target, then replacing our own: the user's .partial / .old stay
        hpf.save(f"{root}/ck", params, info, extra={"step": 1})
        hpf.export_hf(params, info, model, f"{root}/ex")
    out["loads"] = hpf.load(f"{root}/ck", info).extra == {"step": 1}
    return out


def test_save_and_export_never_delete_what_they_did_not_create(tmp_path):
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("the user's")
    (user / "sub" / "data.bin").write_bytes(os.urandom(64))
    for name in ("ck", "ex"):
        (tmp_path / f"{name}.partial").mkdir()
        (tmp_path / f"{name}.partial" / "mine.txt").write_text(f"{name} partial")
        (tmp_path / f"{name}.old").write_text(f"{name} old")
    owned = [user, *(tmp_path / f"{n}.{s}" for n in ("ck", "ex") for s in ("partial", "old"))]
    before = _snapshot(owned)
    for r, got in enumerate(get_pool(2).run(case_user_files, str(tmp_path), timeout=120)):
        for kind in ("save_user_dir", "export_user_dir"):
            assert got[kind] is not None and got[kind][0] == "CheckpointError", (r, kind, got[kind])
            assert "refusing to replace or delete" in got[kind][2] and "user" in got[kind][2], got[kind]
        assert got["loads"]
    assert _snapshot(owned) == before
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old", "ck.partial", "ex", "ex.old", "ex.partial", "user"]


def case_writer_fails(root: str) -> dict:
    """The writing rank fails while preparing, then while writing a part: every rank raises, none
    waits for it, and the earlier export stays as it was."""
    import safetensors.torch

    from hp_functional.train import export

    _, params, info = _shard_mlp()
    model = MLP()
    hpf.export_hf(params, info, model, f"{root}/ex")
    before = sorted(os.listdir(f"{root}/ex"))
    out = {}
    for what, owner, attr in (("prepare", export, "prepare_scratch"), ("write", safetensors.torch, "save_file")):
        original = getattr(owner, attr)

        def fail(*args, **kwargs):
            raise OSError(f"No space left on device ({what})")

        if dist.get_rank() == 0:
            setattr(owner, attr, fail)
        try:
            out[what] = _outcome(hpf.export_hf, params, info, model, f"{root}/ex")
        finally:
            setattr(owner, attr, original)
    out["kept"] = sorted(os.listdir(f"{root}/ex")) == before
    return out


def test_a_failing_writer_raises_on_every_rank(tmp_path):
    for r, got in enumerate(get_pool(2).run(case_writer_fails, str(tmp_path), timeout=60)):
        for what in ("prepare", "write"):
            kind, _, message = got[what]
            assert kind == ("OSError" if r == 0 else "CheckpointError"), (r, what, got[what])
            assert f"No space left on device ({what})" in message, (r, what, message)
        assert got["kept"]


# ---------------------------------------------------------------- exported safetensors verified; an index kept inside its folder
def case_export(src: str, out: str) -> None:
    from hp_functional.tools.models import build_model, tiny_config

    _, params, info, _ = hpf.from_pretrained(src, mesh=mesh())
    meta = build_model(tiny_config("llama", tie_word_embeddings=True), device="meta")
    hpf.export_hf(params, info, meta, out, max_shard_size="40KB")
    _, again, _, _ = hpf.from_pretrained(out, mesh=mesh())  # verified against its manifest, equal
    assert all(torch.equal(again[k], params[k]) for k in params)


def case_from_pretrained(path: str):
    return _outcome(hpf.from_pretrained, path, mesh=mesh())


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    build_hf("llama", make_hf_state("llama", tie_word_embeddings=True), tie_word_embeddings=True).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_corrupt_exported_tensor_is_named_on_every_rank(hf_folder, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "export"
    pool = get_pool(2)
    pool.run(case_export, str(hf_folder), str(out), timeout=120)
    name = "model.layers.0.mlp.down_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    file = out / index["weight_map"][name]
    with safe_open(str(file), framework="pt") as f:
        raw = f.get_tensor(name).contiguous().numpy().tobytes()
    data = file.read_bytes()
    at = data.index(raw) + len(raw) // 2
    file.write_bytes(data[:at] + bytes(b ^ 0x5A for b in data[at:at + 16]) + data[at + 16:])
    for got in pool.run(case_from_pretrained, str(out), timeout=120):
        assert got is not None and got[0] == "CheckpointError", got
        assert file.name in got[2] and repr(name) in got[2] and "checksum" in got[2], got


def test_an_index_cannot_point_outside_its_folder(hf_folder, tmp_path):
    from safetensors import safe_open

    from hp_functional.runtime.weights import open_weights

    (tmp_path / "outside").mkdir()
    shutil.copy(hf_folder / "model.safetensors", tmp_path / "outside" / "x.safetensors")
    for kind, target in (("dotdot", "../outside/x.safetensors"), ("absolute", str(tmp_path / "outside" / "x.safetensors"))):
        folder = tmp_path / kind
        folder.mkdir()
        shutil.copy(hf_folder / "config.json", folder / "config.json")
        with safe_open(str(hf_folder / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, target)}))
        got = _outcome(open_weights, folder)
        assert got is not None and got[0] == "CheckpointError" and target in got[2] and "outside the folder" in got[2], got
