"""A planned skeleton module's forward: its local forward with the pre-lowered steps around it.

``install_boundary`` sets ``module.forward`` to a ``BoundaryForward``: the steps of each planned
argument run on the way in, the module's local forward, then the steps of each planned output.
A ``ConversionCache`` (one per ``apply_fn``, emptied after every call) lets modules that convert
the *same* input tensor the same way share one conversion: q, k and v projections entering
rank-varying compute then have one all-reduce in the backward (their gradients add up before
it), not three — the sum of the all-reduces is the all-reduce of the sum.
"""

from __future__ import annotations

__all__ = ["ConversionCache", "install_boundary"]

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from torch import Tensor, nn

from ..core.errors import CollectiveError, ShapeError
from ..core.lowering import Step
from ..core.signature import ArgSlot, arg_slots, map_output, output_index

#: (id of an input tensor, conversion signature) → (the tensor, its conversion), for one
#: ``apply_fn`` call.  Holding the tensor keeps its id from being reused while cached.  A plain
#: dict, so that ``torch.compile`` traces it without a graph break.
ConversionCache = dict


class _Input(NamedTuple):
    steps: tuple[Step, ...]
    what: str  # "argument 'x'", for errors
    signature: tuple[tuple[str, str, str], ...]  # what the steps do: equal signatures may share a conversion
    name: str | None  # the keyword the argument may be passed by
    position: int | None  # its position (None: keyword-only)


class _Output(NamedTuple):
    index: int
    steps: tuple[Step, ...]
    what: str


def run_steps(steps: Sequence[Step], x: Tensor) -> Tensor:
    """``x`` through every step in order."""
    for step in steps:
        x = step.fn(x)  # Step.__call__ without its frame
    return x


class BoundaryForward:
    """The forward installed on a planned skeleton module (see the module docstring).

    Everything a call needs is laid out in ``__init__``: each planned argument's name, position
    and steps (``inputs``, in slot order) and each planned output's steps, so a call is a loop
    over those with a dict lookup per shared conversion."""

    def __init__(self, fqn: str, inner: Callable, in_steps: Mapping[object, Sequence[Step]],
                 out_steps: Mapping[object, Sequence[Step]], cache: ConversionCache | None):
        self.fqn, self.inner, self.cache = fqn, inner, cache
        self.slots: list[ArgSlot] = arg_slots(inner, list(in_steps), fqn)
        self.inputs = tuple(
            _Input(tuple(in_steps[slot.key]), f"argument {slot.name!r}",
                   tuple((s.axis, s.forward, s.backward) for s in in_steps[slot.key]), slot.name, slot.position)
            for slot in self.slots
        )
        self.outputs = tuple(_Output(output_index(key), tuple(steps), "output" if key == "output" else f"output {key}")
                             for key, steps in out_steps.items())

    def convert(self, value, steps: Sequence[Step], what: str):
        """``value`` through ``steps``; a split the value's shape cannot take is a ShapeError
        naming the module (the same on every rank, so none hangs)."""
        if value is None:
            return value
        if not isinstance(value, Tensor):
            raise TypeError(f"{self.fqn} {what}: the plan places a tensor here, got {type(value).__name__}")
        try:
            return run_steps(steps, value)
        except ValueError as exc:
            raise ShapeError(f"{self.fqn} {what} of shape {tuple(value.shape)} does not fit the plan: {exc}") from exc

    def _convert_input(self, spec: _Input, value):
        cache = self.cache
        if cache is None or not isinstance(value, Tensor):
            return self.convert(value, spec.steps, spec.what)
        key = (id(value), spec.signature)
        hit = cache.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        out = self.convert(value, spec.steps, spec.what)
        cache[key] = (value, out)
        return out

    def __call__(self, *args, **kwargs):
        try:
            return self.run(*args, **kwargs)
        except CollectiveError as exc:  # a collective that timed out or failed: say which module issued it
            if getattr(exc, "module", None) is None:
                exc.module = self.fqn
                exc.args = (f"{exc.args[0]} [module {self.fqn!r}]", *exc.args[1:])
            raise

    def run(self, *args, **kwargs):
        """The call without the error context: convert the arguments, the local forward, convert the outputs."""
        # map_arguments (core.signature) over the laid-out slots: a keyword argument first, else
        # the positional one; an argument not passed is left alone
        if self.inputs:
            args = list(args)
            for spec in self.inputs:
                if spec.name in kwargs:
                    kwargs[spec.name] = self._convert_input(spec, kwargs[spec.name])
                elif spec.position is not None and spec.position < len(args):
                    args[spec.position] = self._convert_input(spec, args[spec.position])
        out = self.inner(*args, **kwargs)
        for o in self.outputs:
            if o.index == 0 and isinstance(out, Tensor):  # map_output's first case, without its closure
                out = self.convert(out, o.steps, o.what)
            else:
                out = map_output(out, o.index, lambda t, o=o: self.convert(t, o.steps, o.what), self.fqn)
        return out


def install_boundary(module: nn.Module, fqn: str, inner: Callable, in_steps: Mapping[object, Sequence[Step]],
                     out_steps: Mapping[object, Sequence[Step]], cache: ConversionCache | None = None) -> None:
    """Make ``module.forward`` run ``inner`` with ``in_steps`` on its arguments and ``out_steps``
    on its outputs (``module`` is the private skeleton's copy).  A module with nothing to convert
    gets ``inner`` alone (often its own forward)."""
    if not in_steps and not out_steps:
        if inner != module.forward:
            module.forward = inner
        return
    module.forward = BoundaryForward(fqn, inner, in_steps, out_steps, cache)
