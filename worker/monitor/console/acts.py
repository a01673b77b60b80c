"""What each of the console's actions does, once ``app.Console`` has let its request through
(a signed-in session, this console's origin, the session's CSRF token): retry, cancel or delete a
task or every task of a filter, cancel a workflow or retry one of its steps, pause or resume a
queue. Each runs with its audit record in one
transaction (``ConsoleData.act``), is logged, and leaves a message for the person's next page.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

import psycopg

from ...coord import pause as _pause
from ...db.dsn import scrub
from ...ops import actions
from ..bounds import clip
from . import jobs as console_jobs
from .auth import Session
from .data import ConsoleData, first_line
from .filter import parse_filter
from .responses import Response, redirect
from .workflow import workflow_link

log = logging.getLogger("worker.console")


def _first(form: Mapping[str, list[str]], key: str) -> str:
    return (form.get(key) or [""])[0]


class Acts:
    """The actions of ``app.Console`` (its ``data`` and ``schema``)."""

    data: ConsoleData
    schema: str

    def _act(
        self,
        session: Session,
        who: tuple[str, str],
        action: str,
        target: Mapping[str, Any],
        fn: Callable[[psycopg.Connection], actions.Outcome | bool],
    ) -> actions.Outcome | None:
        """Run an action with its audit record, log it, and on failure leave a message."""
        name, address = who
        try:
            outcome = self.data.act(fn, actor=name, address=address, action=action, target=target)
        except (psycopg.Error, ValueError) as exc:
            text = scrub(first_line(exc))
            log.warning(
                "console: %s from %s: %s %s failed: %s",
                clip(name, 64),
                address,
                action,
                clip(str(dict(target)), 300),
                text,
            )
            session.flash.append(f"{action} failed: {text}")
            return None
        log.info(
            "console: %s from %s: %s %s: %d row(s) changed",
            clip(name, 64),
            address,
            action,
            clip(str(dict(target)), 300),
            outcome.changed,
        )
        return outcome

    def _task_action(
        self, session: Session, who: tuple[str, str], task_id: int, verb: str
    ) -> Response:
        if task_id >= 2**63:
            return redirect("/console/jobs")
        fn = self._actions(who[0])[verb]
        outcome = self._act(
            session,
            who,
            verb,
            {"task_id": task_id},
            lambda conn: fn(conn, self.schema, [task_id]),
        )
        if outcome is not None:
            past = {"retry": "retried", "cancel": "cancelled", "delete": "deleted"}[verb]
            if outcome.requested:
                session.flash.append(
                    f"task {task_id}: cancel requested; it is running, its worker will stop it"
                )
            elif outcome.changed:
                session.flash.append(f"task {task_id} {past}")
            elif outcome.skipped:
                session.flash.append(
                    f"task {task_id} not retried: a scheduled, queued or running task holds its "
                    "dedupe key"
                )
            else:
                states = ", ".join(console_jobs.BULK[verb][1])
                session.flash.append(f"task {task_id} not {past}: it is gone or no longer {states}")
        if verb == "delete" and outcome is not None and outcome.changed:
            return redirect("/console/jobs")
        return redirect(f"/console/jobs/{task_id}")

    def _bulk(
        self, session: Session, who: tuple[str, str], form: Mapping[str, list[str]]
    ) -> Response:
        action = _first(form, "action")
        f, _ = parse_filter(form)
        back = "/console/jobs?" + urlencode(f.fields())
        if action not in console_jobs.BULK or f.empty or f.id is not None:
            session.flash.append("bulk action refused: it needs an action and a filter")
            return redirect(back)
        states = console_jobs.BULK[action][1]
        try:
            found, more = self.data.matching(f, limit=actions.MAX_IDS)
        except psycopg.Error as exc:
            session.flash.append(f"{action} failed: {scrub(first_line(exc))}")
            return redirect(back)
        ids = [task_id for task_id, state in found if state in states]
        fn = self._actions(who[0])[action]
        target = {"filter": f.fields(), "matched": len(found)}
        outcome = self._act(
            session, who, f"bulk {action}", target, lambda conn: fn(conn, self.schema, ids)
        )
        if outcome is not None:
            text = f"{action}: {outcome.changed:,} of {len(found):,} matching task(s) changed"
            if outcome.skipped:
                text += f"; {outcome.skipped:,} skipped (a live task holds their dedupe key)"
            if outcome.requested:
                text += f" ({outcome.requested:,} running: their workers will stop them)"
            if more:
                text += "; more may match: run it again"
            session.flash.append(text)
        return redirect(back)

    def _workflow_action(
        self,
        session: Session,
        who: tuple[str, str],
        workflow_id: int,
        verb: str,
        form: Mapping[str, list[str]],
    ) -> Response:
        """Cancel a workflow (its unfinished steps), or retry one of its steps (``step``), then
        back to the workflow's page (at ``after``, the page the button was on)."""
        after = _first(form, "after")
        back = workflow_link(workflow_id, after=after if after.isdigit() else "")
        if workflow_id >= 2**63:
            return redirect("/console/jobs")
        if verb == "cancel":
            outcome = self._act(
                session,
                who,
                "cancel workflow",
                {"workflow_id": workflow_id},
                lambda conn: actions.cancel_workflow(
                    conn, self.schema, workflow_id, by=session.name
                ),
            )
            if outcome is not None:
                session.flash.append(
                    f"workflow {workflow_id}: {outcome.changed:,} step(s) cancelled or asked to "
                    "stop"
                    if outcome.changed
                    else f"workflow {workflow_id}: nothing to cancel, every step has finished"
                )
            return redirect(back)
        step = _first(form, "step")
        if not step.isdigit() or not 0 < int(step) < 2**63:
            session.flash.append("retry refused: it needs the step to retry")
            return redirect(back)
        task_id = int(step)
        outcome = self._act(
            session,
            who,
            "retry",
            {"task_id": task_id, "workflow_id": workflow_id},
            lambda conn: actions.retry(conn, self.schema, [task_id]),
        )
        if outcome is not None:
            if outcome.changed:
                session.flash.append(
                    f"step {task_id} retried: the steps its failure cancelled wait for it again"
                )
            elif outcome.skipped:
                session.flash.append(
                    f"step {task_id} not retried: a scheduled, queued or running task holds its "
                    "dedupe key"
                )
            else:
                session.flash.append(
                    f"step {task_id} not retried: it is gone or no longer failed or cancelled"
                )
        return redirect(f"{back}#step-{task_id}")

    @staticmethod
    def _actions(actor: str) -> dict[str, Callable[[psycopg.Connection, str, list[int]], Any]]:
        """The task actions by verb; a cancel records who asked for it in the task row."""
        return {
            "retry": actions.retry,
            "cancel": functools.partial(actions.cancel, by=actor),
            "delete": actions.delete,
        }

    def _queue_action(
        self, session: Session, who: tuple[str, str], verb: str, queue: str
    ) -> Response:
        if not 1 <= len(queue) <= _pause.MAX_QUEUE_CHARS:
            session.flash.append(f"{verb} refused: a queue name is 1 to 255 characters")
            return redirect("/console/queues")
        warned: list[str] = []  # a queue nothing has named yet: paused, with a warning
        if verb == "pause":
            fn: Callable[[psycopg.Connection], bool] = lambda conn: _pause.pause(  # noqa: E731
                conn, self.schema, queue, session.name, warn=warned
            )
        else:
            fn = lambda conn: _pause.resume(conn, self.schema, queue)  # noqa: E731
        outcome = self._act(session, who, verb, {"queue": queue}, fn)
        if outcome is not None:
            shown = clip(queue, 80)
            if verb == "pause":
                done = "paused" if outcome.changed else "was paused already"
            else:
                done = "resumed" if outcome.changed else "was not paused"
            session.flash.append(f"queue {shown} {done}")
            session.flash.extend(f"warning: {clip(w, 600)}" for w in warned)
        return redirect("/console/queues")


__all__ = ["Acts"]
