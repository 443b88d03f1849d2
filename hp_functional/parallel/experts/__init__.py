"""Expert parallelism: routed experts split over the ``ep`` axis, dispatched and combined with a
variable-split all-to-all, and the calling conventions of expert modules."""

__all__: list[str] = []
