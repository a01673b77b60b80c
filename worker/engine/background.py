"""A worker on a thread of the application's own process, for small deployments: a web app that
runs its own tasks without a second service to deploy.

It is the same ``Worker`` as ``worker run`` starts (claims, leases, retries, rescue, graceful
stop), minus what only a process of its own can give: no supervisor restarts it, and its handlers
share the application's CPU and GIL. Past a few tasks a second, run ``worker run`` instead.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ..tasks.registry import Registry
from .loop import Worker
from .settings import WorkerConfig


class BackgroundWorker:
    """``start()`` runs a Worker on a daemon thread and returns once it has started: it checked
    the schema and registered, or ``start()`` raises what stopped it (``SchemaMissing`` naming
    the command to run, an unreachable database), so an application fails at its start-up
    rather than serving requests without its worker. ``stop()`` stops it gracefully (tasks in
    flight finish within ``config.grace_seconds``, the rest are handed back) and waits for it.

    A context manager, sync or async: ``async with BackgroundWorker(config):`` in a FastAPI (or
    any asyncio) lifespan starts and stops it on a thread, so the event loop is not blocked
    meanwhile.
    """

    def __init__(self, config: WorkerConfig, tasks: Registry | None = None, **kwargs: Any):
        self.worker = Worker(config, tasks, **kwargs)
        self._thread = threading.Thread(target=self._run, name="worker-background", daemon=True)
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._raised = False  # start() raised self.error already: stop() does not again

    def _run(self) -> None:
        try:
            self.exit_code = self.worker.run()
        except BaseException as exc:  # kept for stop() to raise: a thread's error is otherwise lost
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> BackgroundWorker:
        """Start the worker and wait until it has registered; raise what made it fail if it
        could not (its thread has ended then: there is nothing to stop)."""
        self._thread.start()
        # The worker's own connection timeouts bound the wait (connect, lock and idle timeouts).
        while not self.worker.started.wait(0.05):
            if not self._thread.is_alive():
                break
        if self.error is not None and not self.worker.started.is_set():
            self._raised = True
            raise self.error
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop gracefully and wait (default: the grace period plus 10 s); returns the worker's
        exit code, or raises what made it fail (a missing schema, an unreachable database)."""
        self.worker.stop()
        if self._thread.ident is not None:
            wait = self.worker.config.grace_seconds + 10 if timeout is None else timeout
            self._thread.join(wait)
            if self._thread.is_alive():
                raise TimeoutError(f"the background worker did not stop within {wait:g}s")
        if self.error is not None and not self._raised:
            raise self.error
        return self.exit_code

    def __enter__(self) -> BackgroundWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> BackgroundWorker:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


__all__ = ["BackgroundWorker"]
