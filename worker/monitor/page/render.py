"""The status page at /: the console's overview (``overview``), read-only, as one HTML document
with its style inline and no script at all (its Content-Security-Policy allows none).

Every value from the database passes through ``esc`` (task names, errors and payload-derived text
are user data) and is cut (``bounds.clip``), and every table shows a bounded number of rows
(queues page by page), so the page stays small whatever a producer wrote.
"""

from __future__ import annotations

from .layout import document, nav, style_sheet
from .markup import esc
from .overview import Overview, Places, jobs_link, overview_body, task_link

PAGER = "?queues_page={n}#queues"


def render_page(
    overview: Overview, *, schema: str, dsn: str, expected_version: int, ttl: float
) -> str:
    """The whole status page: the overview without any action, and links into the console."""
    body = overview_body(
        overview,
        Places(PAGER, jobs_link, task_link),
        schema=schema,
        expected_version=expected_version,
        ttl=ttl,
    )
    meta = (
        f"schema <code>{esc(schema)}</code> · database <code>{esc(dsn)}</code> · read-only, "
        'reload to refresh · <a href="/console/">operator console</a>'
    )
    return document(
        title=f"worker status · {schema}",
        heading="worker status",
        nav_html=nav("overview", {"overview": "/"}),
        meta=meta,
        body=body,
        head=f"<style>{style_sheet()}</style>",
    )


__all__ = ["PAGER", "render_page"]
