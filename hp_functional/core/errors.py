"""The exceptions hp_functional raises; each names the offending module, parameter or axis."""


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
