"""The store: every statement that changes a task row, and nothing else.

A task row changes in one place: the functions of this room (and the SQL functions they call).
They are listed here in the order a task travels: inserted (``inserts``), promoted and claimed
(``claims``), acknowledged or renewed (``acks``), rescued or purged (``recovery``), and acted on
by operators (``operator``). Each module runs the statements of the ``.sql`` file of the same
name beside it; those statements are loaded apart from the rest (``statements``), so no other room
can run one by name, and ``tests/test_store.py`` fails when a statement that writes the task
table runs from anywhere else.

Every function takes a connection and the schema, runs one statement for a whole batch, and
fences on (worker id, attempt) where a worker moves rows it holds.
"""

from .acks import (
    ACK_PIECE,
    ERROR_HISTORY,
    ERROR_HISTORY_CHARS,
    HISTORY,
    Beat,
    Failure,
    complete,
    complete_steps,
    complete_with_result,
    fail,
    hand_back,
    heartbeat,
    notify_done,
    release,
    settle_steps,
    wake_queues,
)
from .claims import (
    ClaimCursor,
    Claimed,
    HandlerLimits,
    Pace,
    Promoted,
    Taken,
    behind,
    claim,
    claim_all,
    due_queues,
    explain_claim,
    make_due,
    pace_ahead,
    parse_notification,
    promote,
    wake_handed_back,
)
from .inserts import copy, cron_slots, delayed_until, insert, insert_async, insert_workflow
from .operator import (
    BulkStep,
    Requeued,
    bulk_step,
    cancel_tasks,
    cancel_workflow,
    delete_tasks,
    requeue,
)
from .recovery import first_expired, purge, rescue, rotate_history, settle_missed, worker_died

__all__ = [
    "ACK_PIECE",
    "ERROR_HISTORY",
    "ERROR_HISTORY_CHARS",
    "HISTORY",
    "Beat",
    "BulkStep",
    "ClaimCursor",
    "Claimed",
    "Failure",
    "HandlerLimits",
    "Pace",
    "Promoted",
    "Requeued",
    "Taken",
    "behind",
    "bulk_step",
    "cancel_tasks",
    "cancel_workflow",
    "claim",
    "claim_all",
    "complete",
    "complete_steps",
    "complete_with_result",
    "copy",
    "cron_slots",
    "delayed_until",
    "delete_tasks",
    "due_queues",
    "explain_claim",
    "fail",
    "first_expired",
    "hand_back",
    "heartbeat",
    "insert",
    "insert_async",
    "insert_workflow",
    "make_due",
    "notify_done",
    "pace_ahead",
    "parse_notification",
    "promote",
    "purge",
    "release",
    "requeue",
    "rescue",
    "rotate_history",
    "settle_missed",
    "settle_steps",
    "wake_handed_back",
    "wake_queues",
    "worker_died",
]
