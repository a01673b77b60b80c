"""Django tasks of the test project, defined as a Django user would."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("django.tasks") is not None:
    from django.tasks import task
else:  # Django before 6.0: the backport
    from django_tasks import task


@task
def add(a: int, b: int) -> dict[str, int]:
    return {"sum": a + b}


@task(queue_name="mail", priority=7)
def send(to: str, *, subject: str = "hi") -> str:
    return f"sent {subject!r} to {to}"


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task(takes_context=True)
def whoami(context, tag: str) -> dict[str, object]:  # Django requires the name "context"
    return {"id": context.task_result.id, "attempt": context.attempt, "tag": tag}


@task(backend="retrying")
def flaky(marker: str) -> int:
    raise RuntimeError(f"always fails ({marker})")


@task(backend="sqlite")
def on_sqlite() -> None:
    return None


@task(backend="unmigrated")
def unmigrated() -> None:
    return None


@task
async def shout(word: str) -> str:
    return word.upper()
