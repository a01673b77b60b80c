"""The console's job pages: the browser (filter, one page of tasks, bulk actions), one task in
full, and the confirmation of a bulk action.

Everything a producer wrote (names, payloads, errors) is cut and escaped by ``esc``.
"""

from __future__ import annotations

from typing import Any

from ..page.layout import help_box
from ..page.markup import STATE_LABELS, age, badge, esc, num, stamp, table
from .data import DETAIL_CHARS, PAGE_ROWS, SCAN_ROWS, STATEMENT_TIMEOUT_MS, Page
from .filter import STATES, Filter
from .views import Frame, jobs_link, layout, task_link

ROW_NAME_CHARS = 80
ROW_TEXT_CHARS = 160
BULK = {
    # action: (button label, states it applies to)
    "retry": ("Retry", ("failed", "cancelled")),
    "cancel": ("Cancel", ("scheduled", "queued", "in_progress")),
    "delete": ("Delete", ("scheduled", "queued", "done", "failed", "cancelled")),
}


def _filter_form(f: Filter) -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if f.state == s else ""}>{STATE_LABELS[s]}</option>'
        for s in STATES
    )
    return (
        '<form class="filter" method="get" action="/console/jobs">'
        f'<label>queue<input name="queue" value="{esc(f.queue or "", 300)}" maxlength="255">'
        "</label>"
        f'<label>task<input name="task" value="{esc(f.task or "", 300)}" maxlength="255"></label>'
        f'<label>state<select name="state"><option value="">any</option>{options}</select></label>'
        f'<label>id<input name="id" value="{esc(f.id or "")}" size="10" inputmode="numeric">'
        "</label>"
        f'<label>text in payload or error<input name="text" value="{esc(f.text or "", 300)}" '
        'maxlength="200"></label>'
        '<button type="submit">Filter</button> <a href="/console/jobs">clear</a></form>'
    )


def _row(r: dict[str, Any]) -> str:
    when_col = r["finished_at"] or r["run_at"]
    text = r["last_error"] or r["payload"] or ""
    if not r["last_error"] and r["payload"] is None:
        text = "(payload too large to show here)"
    length = r["last_error_length"] if r["last_error"] else None
    first_line = text.split("\n", 1)[0]
    return (
        f'<tr data-task-id="{esc(r["id"])}">'
        f'<td class="n"><a href="{task_link(r["id"])}">{esc(r["id"])}</a></td>'
        f"<td>{esc(r['queue'], ROW_NAME_CHARS, length=r['queue_length'])}</td>"
        f"<td>{esc(r['task'], ROW_NAME_CHARS, length=r['task_length'])}</td>"
        f'<td data-col="state">{badge(r["state"])}</td>'
        f'<td class="n">{esc(r["attempts"])}/{esc(r["max_attempts"] or "-")}</td>'
        f"<td>{stamp(when_col)}</td>"
        f'<td class="err">{esc(first_line, ROW_TEXT_CHARS, length=length)}</td></tr>'
    )


def browser(frame: Frame, f: Filter, page: Page, notes: list[str], cursor: str | None) -> str:
    explained = help_box(
        f"Each page walks the index that serves the filter and reads at most {SCAN_ROWS:,} rows; "
        "the text search (case-insensitive, in the payload and the last error) looks only at "
        f"those rows, and a page gives up after {STATEMENT_TIMEOUT_MS / 1000:g} s. Order: newest "
        "first; queued tasks in the order workers take them; scheduled ones next due first; "
        "finished ones newest finished first."
    )
    body = [f'<div class="panel-head"><h2>Jobs</h2>{explained}</div>', _filter_form(f)]
    body += [f'<div class="banner">{esc(n)}</div>' for n in notes]
    if page.error:
        body.append(f'<div class="banner">{esc(page.error)}</div>')
    rows = [_row(r) for r in page.rows]
    listing = table(
        ["id", "queue", "task", "state", "attempts", "finished or due", "last error or payload"],
        rows,
        cls="jobs",
        empty="no task matches" if not page.scanned_to else "none in the rows looked at",
    )
    links = []
    if cursor:
        links.append(f'<a href="/console/jobs?{esc(f.query())}">← first page</a>')
    if page.next_cursor:
        links.append(
            f'<a rel="next" href="/console/jobs?{esc(f.query(cursor=page.next_cursor))}">'
            "next page →</a>"
        )
    if page.scanned_to:
        links.append(
            f"looked at {SCAN_ROWS:,} rows without filling this page: "
            f'<a href="/console/jobs?{esc(f.query(cursor=page.scanned_to))}">'
            "look further →</a>"
        )
    pager = f'<p class="pager">{" ".join(links)}</p>' if links else ""
    # Only a first page that costs no more than its rows refreshes itself: a later page would
    # shift under the reader, and a search would walk its rows again every few seconds.
    live = "" if cursor or f.narrows_walk else " data-live"
    body.append(f'<section class="panel" id="live-jobs"{live}>{listing}{pager}</section>')
    if frame.can_act:
        if f.empty:
            body.append('<p class="note">Set a filter to act on every task it matches.</p>')
        elif f.id is None:
            actions = " ".join(
                f'<a href="/console/jobs/bulk?{esc(f.query(action=name))}">{label} every match…</a>'
                for name, (label, _) in BULK.items()
            )
            body.append(
                f'<h3>Every task this filter matches</h3><div class="pager">{actions}</div>'
            )
    return layout(frame, "jobs", "Jobs", "".join(body))


def _fields(task: dict[str, Any]) -> list[tuple[str, str]]:
    worker = "-"
    if task["worker_id"]:
        worker = f"<code>{esc(task['worker_id'])}</code>"
        if task["worker_host"]:
            stopped = " (stopped)" if task["worker_stopped_at"] else ""
            worker += (
                f" on {esc(task['worker_host'])}, pid {esc(task['worker_pid'])}, heartbeat "
                f"{stamp(task['worker_heartbeat_at'])}{stopped}"
            )
    lease = "-"
    if task["lease_expires_at"] is not None:
        left = task["lease_seconds_left"]
        lease = f"until {stamp(task['lease_expires_at'])}"
        if left is not None:
            lease += f" ({esc(age(left))} left)" if left >= 0 else " (expired)"
    ran = task["ran_seconds"] if task["started_at"] else None
    most = task["max_attempts"] or "the handler's maximum"
    cron = f"{esc(task['cron_key'])} at {stamp(task['cron_at'])}" if task["cron_key"] else "-"
    return [
        ("state", f'<span data-value="state">{badge(task["state"])}</span>'),
        ("queue", f'<a href="{esc(jobs_link(task["queue"]), 5000)}">{esc(task["queue"])}</a>'),
        ("task", esc(task["task"], 1000, length=task["task_length"])),
        ("attempts", f"{esc(task['attempts'])} of {esc(most)}"),
        ("priority", esc(task["priority"])),
        ("created", stamp(task["created_at"])),
        ("run at", stamp(task["run_at"])),
        ("started", stamp(task["started_at"])),
        ("finished", stamp(task["finished_at"])),
        ("waited", esc(age(task["waited_seconds"]))),
        ("ran", esc(age(ran))),
        ("worker", worker),
        ("lease", lease),
        ("handed back", f"{esc(task['handed_back'])} time(s) by workers without its handler"),
        ("dedupe key", esc(task["dedupe_key"] or "-", 1000)),
        ("cron", cron),
        ("cancel", _cancel_text(task)),
        ("workflow", _workflow_text(task)),
    ]


def _workflow_text(task: dict[str, Any]) -> str:
    """The workflow the task is a step of, linked to its page (markup)."""
    if task.get("workflow_id") is None:
        return "-"
    wf = int(task["workflow_id"])
    text = f'<a id="workflow-link" href="/console/workflows/{wf}#step-{int(task["id"])}">'
    text += f"workflow {wf}</a>"
    if task["state"] == "waiting" and task.get("pending_deps"):
        text += f" (waiting for {num(task['pending_deps'])} step(s) to finish)"
    return text


def _cancel_text(task: dict[str, Any]) -> str:
    """Who asked to cancel the task and when, and what that has done so far (markup)."""
    at = task["cancel_requested_at"]
    if at is None:
        return "-"
    who = esc(task["cancelled_by"] or "?")
    if task["state"] == "in_progress":
        return f"requested by {who} at {stamp(at)}: its worker is stopping it"
    return f"by {who} at {stamp(at)}"


def detail(frame: Frame, task: dict[str, Any] | None, task_id: int) -> str:
    if task is None:
        body = (
            f"<h2>Task {esc(task_id)}</h2><p>No task with this id (finished tasks are deleted "
            'once past their retention).</p><p><a href="/console/jobs">back to the jobs</a></p>'
        )
        return layout(frame, "jobs", f"Task {task_id}", body)
    fields = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in _fields(task))
    error = task["last_error"]
    err_html = '<p class="note">No error recorded.</p>'
    if error and task["last_error_length"] is not None:
        shown = esc(error, len(error), length=task["last_error_length"])
        err_html = f'<pre id="last-error">{shown}</pre>'
    elif error:
        err_html = (
            f'<pre id="last-error">{esc(error, len(error))}</pre><p class="note">The first '
            f"{num(len(error))} characters of {size(task['last_error_bytes'])}.</p>"
        )
    actions = ""
    if frame.can_act:
        state = task["state"]
        base = f"/console/jobs/{int(task['id'])}"
        buttons = []
        if state in BULK["retry"][1]:
            buttons.append(frame.button(f"{base}/retry", "Retry"))
        if state in BULK["cancel"][1]:
            buttons.append(frame.button(f"{base}/cancel", "Cancel"))
        if state in BULK["delete"][1]:
            buttons.append(frame.button(f"{base}/delete", "Delete", danger=True))
        if state == "in_progress":
            buttons.append(
                '<span class="note">Cancelling a running task asks its worker to stop it; '
                "the task ends cancelled, never done. It can be neither retried nor deleted "
                "while it runs.</span>"
            )
        actions = f'<div id="actions">{"".join(buttons)}</div>'
    result = _value(task, "result", "Result") if task["result_stored"] is not None else ""
    body = (
        f'<div class="panel-head task-head"><h2>Task {esc(task["id"])}</h2>'
        f"{badge(task['state'])}</div>{actions}"
        f'<section class="panel" id="live-task" data-live><table class="fields">{fields}</table>'
        f"<h3>Last error (attempt {esc(task['attempts'])})</h3>{err_html}</section>"
        f'<section class="panel">{_value(task, "payload", "Payload")}{result}'
        f"{_history(task)}</section>"
    )
    return layout(frame, "jobs", f"Task {task['id']}", body)


def size(n: int | None) -> str:
    """A number of bytes as a person reads it: 950 bytes, 64.0 kB, 52.4 MB."""
    if n is None:
        return "-"
    if n < 1000:
        return f"{n:,} bytes"
    if n < 1_000_000:
        return f"{n / 1000:.1f} kB"
    return f"{n / 1_000_000:,.1f} MB"


def _value(task: dict[str, Any], what: str, title: str) -> str:
    """The payload or the result: as much as DETAIL_CHARS, how large it is, and its download."""
    link = (
        f'<a id="{what}-download" download href="/console/jobs/{int(task["id"])}/{what}.json">'
        f"{what}.json</a>"
    )
    text, length = task[what], task[f"{what}_bytes"]
    if length is None:
        note = (
            f"Too large to show here: {size(task[f'{what}_stored'])} as stored in the database "
            f"(compressed). Download it whole: {link}."
        )
        return f'<h3>{title}</h3><p class="note" id="{what}-note">{note}</p>'
    note = f"{size(length)} of JSON: {link}"
    if len(text) >= DETAIL_CHARS:
        note = (
            f"Cut: the first {num(len(text))} characters of {size(length)} of JSON. Download it "
            f"whole: {link}."
        )
    return (
        f'<h3>{title}</h3><pre id="{what}">{esc(text, len(text))}</pre>'
        f'<p class="note" id="{what}-note">{note}</p>'
    )


def _history(task: dict[str, Any]) -> str:
    """Each recorded attempt's error, newest first (the row keeps the last ten)."""
    errors = task.get("errors") or []
    if task["errors_stored"] is not None and task["errors_bytes"] is None:
        link = f'<a download href="/console/jobs/{int(task["id"])}/errors.json">errors.json</a>'
        return (
            f'<h3>Attempts</h3><p class="note" id="errors-note">The error history is too large '
            f"to show here: {size(task['errors_stored'])} as stored in the database "
            f"(compressed). Download it whole: {link}.</p>"
        )
    if not errors:
        return '<h3>Attempts</h3><p class="note">No attempt has failed.</p>'
    rows = "".join(
        f"<tr><td>{esc(e.get('attempt'))}</td><td>{stamp(e.get('at'))}</td>"
        f"<td>{esc(str(e.get('worker_id') or '')[:8])}</td>"
        f"<td><pre>{esc(e.get('error') or '', len(e.get('error') or ''))}</pre></td></tr>"
        for e in errors
    )
    return (
        '<h3>Attempts</h3><table id="attempts"><thead><tr><th>attempt</th><th>at</th>'
        f"<th>worker</th><th>error</th></tr></thead><tbody>{rows}</tbody></table>"
        '<p class="note">The row keeps the errors of its last ten failed attempts.</p>'
    )


def bulk_confirm(
    frame: Frame,
    f: Filter,
    action: str,
    found: list[tuple[int, str]],
    more: bool,
    limit: int,
) -> str:
    label, states = BULK[action]
    per_state: dict[str, int] = {}
    for _, state in found:
        per_state[state] = per_state.get(state, 0) + 1
    eligible = sum(n for s, n in per_state.items() if s in states)
    summary = ", ".join(f"{num(n)} {badge(s)}" for s, n in sorted(per_state.items())) or "none"
    described = ", ".join(f"{k} = {v}" for k, v in f.fields().items())
    body = [
        f"<h2>{esc(label)} every task of a filter</h2>",
        f"<p>Filter: <code>{esc(described, 2000)}</code></p>",
        f'<p>Matching tasks found: <b id="bulk-found">{num(len(found))}</b> ({summary}). '
        f"{esc(label)} applies to {' '.join(badge(st) for st in states)} tasks: "
        f'<b id="bulk-eligible">{num(eligible)}</b> of them.</p>',
    ]
    if more:
        body.append(
            f'<p class="note">More tasks may match: one action takes at most {limit:,} of them '
            "(in the browser's order); run it again for the rest.</p>"
        )
    if frame.can_act and eligible:
        fields = {**f.fields(), "action": action}
        body.append(
            frame.button("/console/jobs/bulk", f"{label} {eligible:,} tasks", danger=True, **fields)
        )
    body.append(f' <a href="/console/jobs?{esc(f.query())}">back to the list</a>')
    return layout(frame, "jobs", f"{label} tasks", "".join(body))


__all__ = ["BULK", "PAGE_ROWS", "browser", "bulk_confirm", "detail"]
