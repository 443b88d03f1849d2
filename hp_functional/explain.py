"""``explain``: a readable account of what ``shard()`` decided (placements and collectives)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .apply import Program


def _fmt(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def render(program: Program) -> str:
    """Per planned module: its parameters' placements and the lowered collectives."""
    mesh = program.mesh
    lines = [f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))}"]
    for b in program.boundaries:
        p = b.planned
        lines.append(f"{p.fqn}  [{type(p.style).__name__} on {p.axis!r}]")
        prefix = f"{p.fqn}."
        for key, info in program.infos.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                conv = " ; ".join(f"{s.forward}/{s.backward}" for s in program.param_steps.get(key, []))
                lines.append(
                    f"    param {key[len(prefix):]:<10} {_fmt(info.placements)} global {tuple(info.global_shape)}"
                    f" local {tuple(info.local_shape)}" + (f"  use: {conv}" if conv else "")
                )
        for kind, steps in (("in ", b.in_steps), ("out", b.out_steps)):
            for key, ss in steps.items():
                for s in ss:
                    lines.append(f"    {kind} {key!s:<10} {s.axis}: fwd {s.forward}, bwd {s.backward}")
    return "\n".join(lines)
