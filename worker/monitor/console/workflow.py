"""The console's page of one workflow: its steps counted by state, then a page of its steps in
dependency order (each step's dependencies come before it), with each step's task, state,
attempts, how long it ran, what it depends on and its last error; for a signed-in operator, a
button that cancels the workflow and one that retries each failed step.

Everything a producer wrote (names, errors) is cut and escaped by ``esc``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from ..page.layout import help_box
from ..page.markup import STATE_LABELS, age, badge, esc, num, stamp, table
from .data import ROW_CHARS, STEP_DEPS, WORKFLOW_STEPS, WorkflowPage
from .views import Frame, layout, task_link

# The states a step goes through, in that order (a step without dependencies starts queued).
STEP_STATES = ("waiting", "scheduled", "queued", "in_progress", "done", "failed", "cancelled")
FINISHED = ("done", "failed", "cancelled")
HELP = (
    "The steps of one workflow, in dependency order: every step comes after the steps it depends "
    f"on (the order they were enqueued in), {WORKFLOW_STEPS} a page. A step "
    f"{badge('waiting')} waits for its dependencies to finish; “after” lists them (the first "
    f"{STEP_DEPS}), each with what it came to. “ran” is how long its last attempt ran (so far, "
    "for a running step). A step that fails for good cancels the steps that depend on it "
    "(unless they run on failure); retrying it resumes the workflow from there. Cancelling the "
    "workflow cancels its waiting and queued steps and asks its running ones to stop."
)


def workflow_link(workflow_id: int, **params: Any) -> str:
    """A workflow's page in the console (``state``, ``after``: its filter and page)."""
    query = urlencode({k: v for k, v in params.items() if v})
    return f"/console/workflows/{int(workflow_id)}" + (f"?{query}" if query else "")


def _deps(step: dict[str, Any]) -> str:
    deps = step["deps"] or []
    if not deps:
        return "-"
    shown = []
    for d in deps:
        outcome = d.get("outcome")
        mark = badge(outcome) if outcome else '<span class="note">pending</span>'
        anyway = ' <span class="note">(runs on failure)</span>' if d.get("run_on_failure") else ""
        shown.append(f'<a href="#step-{int(d["id"])}">{int(d["id"])}</a> {mark}{anyway}')
    more = int(step["deps_total"] or 0) - len(deps)
    if more > 0:
        shown.append(f'<span class="note">and {num(more)} more</span>')
    return "<br>".join(shown)


def _state(step: dict[str, Any]) -> str:
    text = badge(step["state"])
    if step["state"] == "waiting" and step["pending_deps"]:
        text += f' <span class="note">for {num(step["pending_deps"])}</span>'
    return text


def _ran(step: dict[str, Any]) -> str:
    if step["started_at"] is None:
        return "-"
    return esc(age(step["seconds"]))


def _retryable(step: dict[str, Any]) -> bool:
    """A failed step, or one an operator cancelled (not one its workflow cancelled because a
    dependency failed: retrying the dependency brings it back)."""
    return step["state"] == "failed" or (
        step["state"] == "cancelled" and step["cancelled_by"] != "workflow"
    )


def _row(frame: Frame, wf: WorkflowPage, step: dict[str, Any], after: int) -> str:
    error = step["last_error"] or ""
    first = error.split("\n", 1)[0]
    length = step["last_error_length"] if first == error else None
    action = ""
    if frame.can_act and _retryable(step):
        fields = {"step": str(int(step["id"]))}
        if after:
            fields["after"] = str(after)
        action = frame.button(f"/console/workflows/{wf.id}/retry", "Retry", **fields)
    tries = f"{esc(step['attempts'])}/{esc(step['max_attempts'] or '-')}"
    return (
        f'<tr id="step-{int(step["id"])}" data-step="{int(step["id"])}">'
        f'<td class="n"><a href="{task_link(step["id"])}">{esc(step["id"])}</a></td>'
        f'<td data-col="task">{esc(step["task"], 80, length=step["task_length"])}</td>'
        f'<td data-col="state">{_state(step)}</td>'
        f'<td class="n" data-col="attempts">{tries}</td>'
        f'<td class="n" data-col="ran">{_ran(step)}</td>'
        f'<td data-col="after">{_deps(step)}</td>'
        f'<td class="err" data-col="error">{esc(first, ROW_CHARS, length=length)}</td>'
        f'<td data-col="action">{action}</td></tr>'
    )


def _counts(wf: WorkflowPage, state: str | None) -> str:
    cells = []
    for s in STEP_STATES:
        n = wf.counts.get(s, 0)
        here = ' class="here"' if s == state else ""
        link = workflow_link(wf.id, state=s) + "#steps"
        cells.append(
            f'<div class="card card-{s}" data-count="{s}"><b><a{here} href="{esc(link, 1000)}">'
            f"{num(n)}</a></b><span>{badge(s)}</span></div>"
        )
    return '<div class="cards">' + "".join(cells) + "</div>"


def page(
    frame: Frame, wf: WorkflowPage | None, workflow_id: int, state: str | None, after: int
) -> str:
    if wf is None:
        body = (
            f"<h2>Workflow {esc(workflow_id)}</h2><p>No workflow with this id (a workflow goes "
            'once retention has deleted its last step).</p><p><a href="/console/jobs">back to '
            "the jobs</a></p>"
        )
        return layout(frame, "jobs", f"Workflow {workflow_id}", body)
    name = f" <code>{esc(wf.name)}</code>" if wf.name else ""
    progress = "finished" if not wf.unfinished else f"{num(wf.unfinished)} step(s) not finished"
    took = "-"
    if wf.first_started is not None and wf.last_finished is not None and not wf.unfinished:
        took = esc(age((wf.last_finished - wf.first_started).total_seconds()))
    facts = (
        f'<p class="wf-facts"><b id="wf-total">{num(wf.total)}</b> steps · '
        f'<span id="wf-progress">{progress}</span> · created {stamp(wf.created_at)} · first '
        f"step started {stamp(wf.first_started)} · last step finished "
        f"{stamp(wf.last_finished)} · took {took}</p>"
    )
    actions = ""
    if frame.can_act and wf.unfinished:
        actions = (
            '<div id="actions">'
            + frame.button(f"/console/workflows/{wf.id}/cancel", "Cancel workflow", danger=True)
            + '<span class="note">Cancels its waiting and queued steps; running steps are asked '
            "to stop and end cancelled.</span></div>"
        )
    rows = [_row(frame, wf, s, after) for s in wf.steps]
    shown = f"only {badge(state)} steps · " if state else ""
    listing = table(
        ["step", "task", "state", "attempts", "ran", "after", "last error", ""],
        rows,
        cls="steps",
        empty=f"no {STATE_LABELS[state]} step" if state else "no step",
    )
    links = []
    if after or state:
        first_page = esc(workflow_link(wf.id), 1000)
        links.append(f'<a href="{first_page}#steps">← all steps, first page</a>')
    if wf.next_after is not None:
        href = workflow_link(wf.id, state=state or "", after=wf.next_after) + "#steps"
        links.append(f'<a rel="next" href="{esc(href, 1000)}">next {WORKFLOW_STEPS} steps →</a>')
    pager = f'<p class="pager">{" ".join(links)}</p>' if links else ""
    first = f"after step {num(after)} · " if after else ""
    body = (
        f'<div class="panel-head task-head"><h2>Workflow {esc(wf.id)}{name}</h2>'
        f"{help_box(HELP)}</div>"
        # The actions refresh with the rest: a workflow that finishes has nothing to cancel.
        f'<section class="panel" id="live-workflow" data-live>{actions}{facts}'
        f"{_counts(wf, state)}"
        f'<h3 id="steps">Steps</h3><p class="note">{shown}{first}in dependency order</p>'
        f"{listing}{pager}</section>"
    )
    return layout(frame, "jobs", f"Workflow {wf.id}", body)


__all__ = ["STEP_STATES", "page", "workflow_link"]
