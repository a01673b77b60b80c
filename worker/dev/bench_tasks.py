"""The no-op task `worker bench` drains; imported by the benchmark's worker processes."""

from typing import Any

from ..tasks.registry import registry


@registry.task("bench.noop")
def noop(payload: Any) -> None:
    """Does nothing, so the benchmark measures the queue and not the work."""
