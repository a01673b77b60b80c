"""An application process for the composition matrix (tests/test_matrix.py).

``python matrix_app.py serve [--django]``: an application that runs its tasks on a
worker.BackgroundWorker in its own process (the in-process worker), stopped gracefully on SIGTERM
as a web framework's lifespan would stop it; with ``--django`` a Django application whose worker
serves Django's tasks (worker.contrib.django's DjangoRegistry).

``python matrix_app.py enqueue-django SLEEP N LATER LONG LONG_SLEEP``: a Django producer,
enqueueing N runs of django_site.matrix_tasks.run through Django's own ``.enqueue()`` (the first
LONG of them working LONG_SLEEP seconds, the others SLEEP), then LATER more due in ten minutes;
prints the ids, one a line.

Environment: WORKER_DSN and WORKER_SCHEMA (the queue), MATRIX_LEASE and MATRIX_CONCURRENCY (the
worker's), and for Django DJANGO_SITE_DSN, DJANGO_SITE_SCHEMA and DJANGO_SETTINGS_MODULE.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def serve(django_tasks: bool) -> int:
    import worker

    registry = None
    if django_tasks:
        import django

        django.setup()
        from worker.contrib.django.registry import DjangoRegistry

        registry = DjangoRegistry()
    else:
        import matrix_module  # noqa: F401  (registers the matrix's tasks)

    config = worker.WorkerConfig(
        dsn=os.environ["WORKER_DSN"],
        schema=os.environ["WORKER_SCHEMA"],
        queues=["mx"],
        concurrency=int(os.environ.get("MATRIX_CONCURRENCY", "3")),
        lease_seconds=float(os.environ.get("MATRIX_LEASE", "3")),
        grace_seconds=5.0,
        poll_interval=0.2,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    background = worker.BackgroundWorker(config, registry).start()
    while not stop.wait(0.2):
        if not background.running:  # it failed to start: say why
            return background.stop() or 1
    return background.stop() or 0


def enqueue_django(sleep: float, n: int, later: int, long: int, long_sleep: float) -> int:
    import datetime

    import django

    django.setup()
    from django_site.matrix_tasks import run

    for i in range(n):
        print(run.enqueue(long_sleep if i < long else sleep, key=f"k{i}").id, flush=True)
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=10)
    for i in range(later):
        print(run.using(run_after=when).enqueue(sleep, key=f"late{i}").id, flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(serve("--django" in sys.argv[2:]))
    sleep, n, later, long, long_sleep = sys.argv[2:7]
    sys.exit(enqueue_django(float(sleep), int(n), int(later), int(long), float(long_sleep)))
