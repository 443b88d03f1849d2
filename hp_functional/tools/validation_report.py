"""What ``validate`` reports: the rows it compared and the errors it raises (shared with the
DTensor mode in ``validate_dtensor``)."""

from __future__ import annotations

__all__ = ["Diff", "PlacementMismatchError", "ReplicaMismatch", "ValidationError", "ValidationReport"]

from dataclasses import dataclass, field

from ..core.placement import fmt_placements as _fmt


class ValidationError(AssertionError):
    """The sharded run does not match the unsharded model; ``report`` holds every row.

    An ``AssertionError``, not a ``PlanError``: the plan *applied* (``PlanError`` means "cannot be
    applied, raised before any collective"); what failed is a check of its results, as in a test.
    """

    def __init__(self, message: str, report: ValidationReport | None = None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return type(self), (str(self), self.report)


class PlacementMismatchError(ValidationError, ValueError):
    """DTensor propagation gives a planned module's input or output another placement than the
    plan declares (upstream's contract: ``module``, ``expected``, ``actual``, ``stage``); also a
    ``ValueError``, as upstream."""

    def __init__(self, module: str, expected: tuple, actual: tuple, stage: str = "out_src", key: object = "output"):
        self.module, self.expected, self.actual, self.stage, self.key = module, tuple(expected), tuple(actual), stage, key
        super().__init__(
            f"[{module}] {stage} placement mismatch for {key!r}: expected {_fmt(self.expected)} (declared by the "
            f"plan), actual {_fmt(self.actual)} (DTensor propagation); check the plan entry for this module"
        )

    def __reduce__(self):
        return type(self), (self.module, self.expected, self.actual, self.stage, self.key)


@dataclass(frozen=True)
class Diff:
    """One compared tensor: a module output (``what`` "output", "output[1]", ...) or a gradient."""

    name: str  # module FQN or parameter FQN
    what: str
    max_abs: float
    max_rel: float  # max_abs / max |reference|
    ok: bool
    note: str = ""  # placements used, or why it could not be compared
    compared: bool = True  # False: one side returns no tensor for this output (e.g. no attention weights)


@dataclass(frozen=True)
class ReplicaMismatch:
    """A replicated parameter whose gradient differs between the ranks of ``axis``."""

    param: str
    axis: str
    max_abs: float  # largest difference from the axis' first rank


@dataclass
class ValidationReport:
    """What ``validate`` found.  ``modules``: failing rows first, in forward order (the first one
    is where the sharded run starts to diverge; later ones inherit its error), then the passing
    rows worst first.  ``params``: gradient rows worst first.  Identical on every rank."""

    modules: list[Diff] = field(default_factory=list)
    params: list[Diff] = field(default_factory=list)
    mismatched_replicas: list[ReplicaMismatch] = field(default_factory=list)
    placement_mismatches: list[PlacementMismatchError] = field(default_factory=list)
    placements_checked: int = 0  # dtensor mode: declared placements compared with DTensor's
    mode: str = "numeric"
    tolerance: float = 0.0
    replication: list[str] = field(default_factory=list)  # Local outputs declared Replicate that differ per rank

    @property
    def ok(self) -> bool:
        return not (self.failed_modules or self.failed_params or self.mismatched_replicas or self.placement_mismatches
                    or self.replication)

    @property
    def failed_modules(self) -> list[Diff]:
        return [d for d in self.modules if not d.ok]

    @property
    def failed_params(self) -> list[Diff]:
        return [d for d in self.params if not d.ok]

    def summary(self) -> str:
        """One line naming the worst offenders first."""
        if self.ok and self.mode == "dtensor":
            return f"validate (dtensor): ok, {self.placements_checked} declared placements match DTensor propagation"
        if self.ok:
            skipped = sum(not d.compared for d in self.modules)
            return (f"validate ({self.mode}): ok, {len(self.modules) - skipped} module outputs and {len(self.params)} "
                    f"gradients match" + (f" ({skipped} outputs not compared: one side returns no tensor)" if skipped else ""))
        parts = [str(e) for e in self.placement_mismatches[:1]] + self.replication[:1]
        if self.failed_modules:
            d = self.failed_modules[0]
            parts.append(f"first diverging module {d.name} {d.what} (max|Δ| {d.max_abs:.3g}, rel {d.max_rel:.3g})")
        if self.failed_params:
            d = self.failed_params[0]
            parts.append(f"worst gradient {d.name} (max|Δ| {d.max_abs:.3g}, rel {d.max_rel:.3g})")
        if self.mismatched_replicas:
            r = self.mismatched_replicas[0]
            parts.append(f"replicated gradient {r.param} differs across axis {r.axis!r} (max|Δ| {r.max_abs:.3g})")
        counts = [(len(self.placement_mismatches), "placements"), (len(self.failed_modules), "module outputs"),
                  (len(self.failed_params), "gradients"), (len(self.mismatched_replicas), "replicated gradients"),
                  (len(self.replication), "replicated Local outputs")]
        failing = ", ".join(f"{n} {what}" for n, what in counts if n)
        return f"validate ({self.mode}) failed: " + "; ".join(parts) + f" [failing: {failing}]"

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  placement  {e}" for e in self.placement_mismatches]
        lines += [f"  FAIL replication {e}" for e in self.replication]
        rows = [("module", d) for d in self.modules] + [("grad", d) for d in self.params]
        if rows:
            width = max(len(d.name) + len(d.what) for _, d in rows) + 1
            lines.append(f"  {'':4} {'kind':6} {'name':<{width}} {'max|Δ|':>9} {'rel':>9}  note")
            for kind, d in rows:
                label = d.name + ("" if kind == "grad" else " " + d.what)
                if not d.compared:
                    lines.append(f"  {'--':4} {kind:6} {label:<{width}} {'-':>9} {'-':>9}  {d.note}")
                    continue
                status = "ok" if d.ok else "FAIL"
                lines.append(f"  {status:4} {kind:6} {label:<{width}} {d.max_abs:9.2e} {d.max_rel:9.2e}  {d.note}")
        lines += [f"  FAIL replica {r.param} on axis {r.axis!r}: max|Δ| between ranks {r.max_abs:.3g}"
                  for r in self.mismatched_replicas]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise the first ``PlacementMismatchError``, else a ``ValidationError`` naming the worst
        offenders first; do nothing when the report is ok."""
        if self.placement_mismatches:
            raise self.placement_mismatches[0]
        if not self.ok:
            failing = [r for r in str(self).splitlines()[1:] if "FAIL" in r]
            raise ValidationError("\n".join([self.summary(), *failing[:20]]), self)
