"""What a worker process is told: ``WorkerConfig``, filled by the CLI from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerConfig:
    """Everything a worker process needs; the CLI fills it from flags and the environment."""

    dsn: str
    schema: str = "worker"
    queues: list[str] | None = None  # None: the queues of the registered tasks, plus "default"
    concurrency: int = 100
    batch_size: int = 100
    lease_seconds: float = 30.0
    poll_interval: float = 1.0
    grace_seconds: float = 30.0
    listen: bool = True
    listen_dsn: str | None = None  # a direct connection for LISTEN when dsn goes through PgBouncer
    keep_done_seconds: float = 3600.0  # 0: delete rows as they complete
    keep_failed_seconds: float = 7 * 86400.0
    # Done rows leave the task table at their acknowledgement for the history (schema/0025),
    # which retention empties a slice at a time (`worker run --keep-history`). Every reader of
    # finished rows in the package reads both; off by default, because a query of the user's own
    # that reads finished tasks from `tasks` would miss them (`task_rows` has both).
    keep_history: bool = False
    cron_keep_seconds: float = 86400.0
    purge_interval: float = 60.0
    max_abandoned: int | None = None  # stuck handler threads tolerated before the process gives up
    check_schema: bool = True
    # Behind PgBouncer in transaction mode, server-side prepared statements break: turn them off.
    prepare: bool = True
    burst: bool = False  # stop once nothing is due and nothing is in flight
    worker_id: str | None = None  # default: $WORKER_ID (set by a supervisor), else a new uuid
    # Store every handler's return value (a handler's own store_result wins; see tasks.results), up
    # to max_result_bytes of JSON each. Storing needs keep_done_seconds > 0.
    store_results: bool = False
    max_result_bytes: int = 64 * 1024
    # The process ends with the worker (`worker run`): handlers still running at the end of a
    # graceful stop end with it, so their rows go back at once. False in an application's own
    # process, where their threads run on (see engine.stopping).
    exits_after_stop: bool = False

    @property
    def heartbeat_seconds(self) -> float:
        return max(self.lease_seconds / 3, 0.05)

    @property
    def rescue_seconds(self) -> float:
        return max(self.lease_seconds / 4, 0.1)


__all__ = ["WorkerConfig"]
