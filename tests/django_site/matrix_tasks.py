"""Django tasks of the composition matrix (tests/test_matrix.py): one task, on the matrix's own
backend alias (TASKS["matrix"], queue ``mx``, ten attempts), that records its run as the
matrix's other handlers do (tests/matrix_module.py). A Django task cannot see a cancel request
(it has no worker context), so it runs to its end: the database ends the row cancelled."""

from __future__ import annotations

import importlib.util

from matrix_module import record_run

if importlib.util.find_spec("django.tasks") is not None:
    from django.tasks import task
else:  # Django before 6.0: the backport
    from django_tasks import task


@task(takes_context=True, queue_name="mx", backend="matrix")
def run(context, sleep: float, key: str = "") -> dict[str, object]:  # Django requires "context"
    result = context.task_result
    return record_run(int(result.id), context.attempt, result.worker_ids[-1], sleep)
