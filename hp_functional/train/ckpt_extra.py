"""``extra`` on disk without pickle: JSON for the structure, safetensors for the tensors.

Allowed values: ``None``, ``bool``, ``int``, ``float``, ``str``, tensors (dense, any dtype
safetensors stores; they load on the CPU), and ``list`` / ``tuple`` / ``dict`` with ``str`` keys
of those, nested.  Anything else (a numpy scalar, a dataclass, an enum, a dict with int keys) is
refused at ``save`` time, naming its place (``extra['loader']['pos']``), because it could only be
stored as a pickle, and loading a pickle runs code.  The encoding is ``8-byte length + JSON +
safetensors``; every container is tagged (``{"dict": ...}``, ``{"list": ...}``, ``{"tuple": ...}``,
``{"tensor": name}``), so decoding is a plain tree walk.
"""

from __future__ import annotations

__all__ = ["decode", "encode"]

import json
import struct
from typing import Any

import torch
from torch import Tensor

from ..core.errors import CheckpointError

_SCALARS = (bool, int, float, str)


def encode(extra: Any, where: str = "save") -> bytes:
    """``extra`` as bytes (a snapshot: later changes to it are not saved); a ``CheckpointError``
    naming the first value that cannot be stored without pickle."""
    from safetensors.torch import save as st_save

    tensors: dict[str, Tensor] = {}

    def enc(v: Any, at: str) -> Any:
        if v is None or type(v) in _SCALARS:
            return v
        if isinstance(v, Tensor):
            if v.is_meta or v.layout != torch.strided or v.is_quantized:
                raise CheckpointError(f"{where}: {at} is a {v.layout} {'meta ' if v.is_meta else ''}tensor; extra stores "
                                      "dense tensors with values")
            name = f"t{len(tensors)}"
            tensors[name] = v.detach().to("cpu", copy=True).contiguous()
            return {"tensor": name}
        if type(v) in (list, tuple):
            return {type(v).__name__: [enc(x, f"{at}[{i}]") for i, x in enumerate(v)]}
        if type(v) is dict:
            bad = [k for k in v if type(k) is not str]
            if bad:
                raise CheckpointError(f"{where}: {at} has a key {bad[0]!r} of type {type(bad[0]).__name__}; extra's dict "
                                      "keys must be str (it is stored as JSON, not pickled)")
            return {"dict": {k: enc(x, f"{at}[{k!r}]") for k, x in v.items()}}
        raise CheckpointError(f"{where}: {at} is a {type(v).__module__}.{type(v).__qualname__}, which extra cannot store: "
                              "it holds None, bool, int, float, str, tensors and list/tuple/dict of them (stored as JSON "
                              "and safetensors, never pickled, so that loading runs no code); convert it first "
                              "(e.g. .item(), .tolist(), dataclasses.asdict)")

    tree = json.dumps(enc(extra, "extra")).encode()
    try:
        blob = st_save(tensors) if tensors else b""
    except Exception as exc:  # noqa: BLE001 - an unstorable tensor (dtype safetensors lacks), named
        raise CheckpointError(f"{where}: extra's tensors cannot be stored as safetensors: {exc}") from None
    return struct.pack("<Q", len(tree)) + tree + blob


def decode(data: bytes, where: str) -> Any:
    """The ``extra`` that ``encode`` stored (tensors on the CPU); a ``CheckpointError`` for anything
    that is not such an encoding.  JSON and safetensors only: nothing here runs code from the file."""
    from safetensors.torch import load as st_load

    try:
        (n,) = struct.unpack_from("<Q", data)
        tree = json.loads(data[8:8 + n])
        tensors = st_load(bytes(data[8 + n:])) if len(data) > 8 + n else {}
    except Exception as exc:  # noqa: BLE001 - any malformed encoding is a corrupt checkpoint
        raise CheckpointError(f"{where}: its extra is not a valid encoding (JSON + safetensors): {type(exc).__name__}: "
                              f"{exc}") from None

    def dec(node: Any) -> Any:
        if node is None or type(node) in _SCALARS:
            return node
        if type(node) is dict and len(node) == 1:
            (tag, value), = node.items()
            if tag == "tensor" and value in tensors:
                return tensors[value]
            if tag in ("list", "tuple") and type(value) is list:
                items = [dec(x) for x in value]
                return items if tag == "list" else tuple(items)
            if tag == "dict" and type(value) is dict:
                return {k: dec(x) for k, x in value.items()}
        raise CheckpointError(f"{where}: its extra holds an unknown node {str(node)[:80]!r}: a corrupt checkpoint")

    return dec(tree)
