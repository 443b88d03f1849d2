"""The ``hp-functional`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp-functional", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shard a tiny HF Llama with TP and train it beside the unsharded model")
    demo.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--device", default="cpu", help="mesh device type: cpu (gloo), cuda (nccl), npu (hccl)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        import os

        from .demo import train
        from .launch import run_ranks

        os.environ.setdefault("HPF_BACKEND", {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(args.device, "gloo"))
        results = run_ranks(train, args.nproc, args.steps, 0.2, args.device)
        history = next(iter(results.values()))
        worst = max(abs(a - b) for a, b in history)
        return 0 if worst < 1e-4 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
