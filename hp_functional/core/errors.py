"""The exceptions hp_functional raises; each names the offending module, parameter or axis."""

__all__ = [
    "CheckpointError", "CollectiveError", "InputMismatchError", "PlanError", "PlanMismatchError", "PlanWarning",
    "ReentrancyError", "ReplicationError", "ShapeError"
]


class PlanError(ValueError):
    """The plan cannot be applied to this model and mesh (raised on every rank before any collective)."""


class ShapeError(PlanError):
    """A dimension does not divide by the size of the mesh axis that shards it."""


class PlanMismatchError(PlanError):
    """Ranks resolved different sharding (model config, plan, mesh or library version differ)."""


class PlanWarning(UserWarning):
    """The plan is applicable but probably not what was meant (see ``lint``)."""


class ReplicationError(RuntimeError):
    """A value declared Replicate differs across the ranks of its axis (``Local(check=True)``,
    ``validate``): a partial sum left unreduced or a rank-dependent value.  Raised on every rank
    of the axis alike (the check all-gathers first)."""


class CheckpointError(ValueError):
    """A checkpoint on disk is incomplete, corrupt or does not fit the target layout (``hpf.load``;
    raised on every rank before any collective)."""


class InputMismatchError(ReplicationError):
    """An ``apply_fn`` input that the plan needs alike on every rank of a mesh axis differs there
    (its shape, or with ``HPF_CHECK_INPUTS=1`` its values); names the argument, the axis and the
    ranks.  Raised on every rank of the axis before any collective of the call."""


class CollectiveError(RuntimeError):
    """A collective the library issued failed or did not complete within the timeout
    (``hpf.set_timeout``): a rank stuck, dead or out of step.  Names the collective, the mesh
    axis and, where known, the module."""


class ReentrancyError(RuntimeError):
    """``apply_fn`` on a multi-rank mesh was called from a thread other than the one that built
    it: collectives from two threads cannot be ordered alike on every rank."""
