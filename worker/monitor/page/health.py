"""The overview's "Database health" panel: `worker doctor`'s findings (without the claim
probe) as HTML.

Findings carry text from the database (application names, queue and task names, a session's
last query with its secrets masked): every piece goes through ``esc``, which cuts and escapes it.
Problems are listed first, critical before warnings, each with what to do; the checks that found
nothing are folded into one line.
"""

from __future__ import annotations

from ..doctor.checkup import Report
from ..doctor.findings import ordered
from .layout import panel
from .markup import age, esc, stamp

SUMMARY_CHARS = 1200  # a finding's summary or action on the page
SHOWN = 50  # findings listed at most
_CLASS = {"critical": "bad", "warning": "warn", "ok": "ok"}
HEALTH_HELP = (
    "The checks of <code>worker doctor</code> (all but the cost of the claim), run again at most "
    "once per refresh of the page's data: connections, long transactions and what holds vacuum "
    "back, table bloat, the routing of queues and tasks. Problems come first, critical before "
    "warnings, each with what to do. <code>worker doctor</code> runs them too, with the claim's "
    "cost and options for every threshold."
)


def render_doctor_panel(report: Report | None) -> str:
    """The panel's HTML ('' without a report: the page was built before any health read)."""
    if report is None:
        return ""
    parts = []
    problems = report.problems()
    if report.error:
        parts.append(
            f'<p class="note bad">The health checks could not run: {esc(report.error)}</p>'
        )
    elif problems:
        rows = []
        for f in problems[:SHOWN]:
            cls = _CLASS[f.severity]
            rows.append(
                f'<tr data-code="{esc(f.code)}" data-severity="{esc(f.severity)}">'
                f'<td class="{cls}">{esc(f.severity)}</td><td><code>{esc(f.code)}</code></td>'
                f"<td>{esc(f.summary, SUMMARY_CHARS)}</td>"
                f"<td>{esc(f.action, SUMMARY_CHARS)}</td></tr>"
            )
        parts.append(
            '<table class="health"><thead><tr><th>severity</th><th>check</th><th>finding</th>'
            f"<th>what to do</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )
        if len(problems) > SHOWN:
            parts.append(f'<p class="note">... and {len(problems) - SHOWN} more.</p>')
    ok = [f for f in ordered(report.findings) if f.severity == "ok"]
    if ok:
        codes = ", ".join(dict.fromkeys(f.code for f in ok))
        parts.append(
            f'<p class="note ok">{len(ok)} check(s) ok: {esc(codes, SUMMARY_CHARS)}.</p>'
            if problems or report.error
            else f'<p class="note ok">All {len(ok)} checks ok: {esc(codes, SUMMARY_CHARS)}.</p>'
        )
    parts.append(
        f'<p class="note">As of {stamp(report.wall)} (took {esc(age(report.duration))}).</p>'
    )
    return panel("health", "Database health", "".join(parts), help=HEALTH_HELP)


__all__ = ["render_doctor_panel"]
