"""What every page of the one UI shares, the status page's and the console's: the document and its
header, the navigation, and the panel (a heading, a "?" that opens its explanation, then the
data).

An explanation is a ``<details>`` element: closed, it is one "?" beside the heading and the panel
shows its data first; it opens without a script, so it works on the status page, which has none.
"""

from __future__ import annotations

from importlib import resources

from .markup import esc

NAV = (
    ("/console/", "overview", "Overview"),
    ("/console/jobs", "jobs", "Jobs"),
    ("/console/queues", "queues", "Queues"),
    ("/console/cron", "cron", "Cron"),
    ("/console/locks", "locks", "Locks"),
)
STYLE_SHEET = "console.css"


def style_sheet() -> str:
    """The UI's style sheet (also served as /console/static/console.css)."""
    return (resources.files("worker.monitor") / "static" / STYLE_SHEET).read_text("utf-8")


def nav(here: str, hrefs: dict[str, str] | None = None) -> str:
    """The navigation, ``here`` marked; ``hrefs`` replaces links by key (the status page's
    overview is ``/``)."""
    links = []
    for href, key, label in NAV:
        target = (hrefs or {}).get(key, href)
        mark = ' class="here" aria-current="page"' if key == here else ""
        links.append(f'<a href="{esc(target, 1000)}"{mark}>{label}</a>')
    return "<nav>" + "".join(links) + "</nav>"


def document(
    *, title: str, heading: str, nav_html: str, meta: str, body: str, head: str, attrs: str = ""
) -> str:
    """A whole page. ``head``: what loads its style (and script); ``meta``: the line under the
    header (already escaped); ``body``: the content of ``<main>``; ``attrs``: the ``<body>``
    element's attributes (already escaped)."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title, 500)}</title>{head}</head>"
        f"<body{attrs}>"
        f'<header><div class="brand"><h1>{esc(heading)}</h1>{nav_html}</div>'
        f'<div class="meta">{meta}</div></header><main>{body}</main></body></html>'
    )


def help_box(text: str) -> str:
    """The "?" of a panel: ``text`` (markup, already escaped), shown when it is opened."""
    return (
        '<details class="help"><summary title="What is this?" aria-label="What is this?">?'
        f'</summary><div class="help-body">{text}</div></details>'
    )


def panel(key: str, title: str, body: str, *, help: str = "", live: bool = True) -> str:
    """A panel: its heading (id ``key``) with the "?" of ``help``, then ``body`` in an element
    (id ``live-KEY``) that the console's script refreshes in place when ``live``."""
    refresh = " data-live" if live else ""
    return (
        f'<section class="panel" id="panel-{key}"><div class="panel-head">'
        f'<h2 id="{key}">{title}</h2>{help_box(help) if help else ""}</div>'
        f'<div class="panel-body" id="live-{key}"{refresh}>{body}</div></section>'
    )


__all__ = ["NAV", "document", "help_box", "nav", "panel", "style_sheet"]
