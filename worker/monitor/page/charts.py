"""The charts of the overview, drawn on the server as inline SVG: no script, no CDN, nothing the
pages' Content-Security-Policy has to allow.

Every chart has its axes with tick labels and a title on each, a legend in words beside the
colours, and a tooltip (``<title>``) on each bar or point. The figures it plots are on its marks
as data attributes (``data-done``, ``data-value``, ...), with the plot's geometry on the ``<svg>``
(``data-y-max``, ``data-plot-top``, ``data-plot-bottom``, ``data-start``, ``data-end``), so that
what is drawn can be checked against the database. Queue names are escaped and cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from .markup import esc, num, when
from .trends import MINUTES, Throughput, Trends, Wait

GAP = timedelta(seconds=150)  # samples further apart than this are not joined by a line


@dataclass(frozen=True)
class Plot:
    """A chart's frame: its size, the plotting area inside its margins, and the scales."""

    start: datetime
    end: datetime
    y_max: float
    width: int = 600
    height: int = 200
    left: int = 56
    right: int = 12
    top: int = 24
    bottom: int = 34

    @property
    def inner_width(self) -> float:
        return self.width - self.left - self.right

    @property
    def base(self) -> float:
        """The y of zero: the bottom of the plotting area."""
        return float(self.height - self.bottom)

    @property
    def inner_height(self) -> float:
        return self.base - self.top

    def x(self, at: datetime) -> float:
        span = (self.end - self.start).total_seconds() or 1.0
        return self.left + (at - self.start).total_seconds() / span * self.inner_width

    def y(self, value: float) -> float:
        return self.base - value / self.y_max * self.inner_height


def nice_top(value: float, *, whole: bool = False) -> tuple[float, float]:
    """The top of an axis that holds ``value`` and its step: 1, 2 or 5 times a power of ten, about
    four steps; whole numbers of at least 1 when ``whole``."""
    if value <= 0 or not math.isfinite(value):
        return (1.0, 1.0) if whole else (1.0, 0.25)
    raw = value / 4
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if whole:
        step = max(1.0, round(step))
    return math.ceil(value / step - 1e-9) * step, step


def count_label(n: float) -> str:
    """A count on an axis: 950, 9,500, 95k, 1.5M."""
    if n < 10_000:
        return num(n)
    if n < 1_000_000:
        return f"{n / 1000:g}k"
    return f"{n / 1_000_000:g}M"


def seconds_label(s: float) -> str:
    """Seconds on an axis: 0, 250 ms, 1.5 s, 2 min."""
    if s == 0:
        return "0"
    if s < 1:
        return f"{s * 1000:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def _f(v: float) -> str:
    return f"{v:.1f}"


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hhmm(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%H:%M")


def _axes(
    p: Plot, step: float, y_title: str, label: Callable[[float], str], every_minutes: int
) -> str:
    """Grid lines and the two axes, tick labels on each, and their titles."""
    parts = []
    n = 0
    while n * step <= p.y_max + 1e-9:
        v = n * step
        y = _f(p.y(v))
        parts.append(
            f'<line class="grid" x1="{p.left}" y1="{y}" x2="{p.width - p.right}" y2="{y}"></line>'
            f'<text class="tick tick-y" x="{p.left - 6}" y="{_f(p.y(v) + 4)}">{esc(label(v))}'
            "</text>"
        )
        n += 1
    first = p.start.astimezone(UTC).replace(second=0, microsecond=0)
    first += timedelta(minutes=-first.minute % every_minutes)
    at = first
    while at <= p.end:
        x = _f(p.x(at))
        parts.append(
            f'<line class="tick" x1="{x}" y1="{_f(p.base)}" x2="{x}" y2="{_f(p.base + 4)}"></line>'
            f'<text class="tick tick-x" x="{x}" y="{_f(p.base + 16)}">{_hhmm(at)}</text>'
        )
        at += timedelta(minutes=every_minutes)
    parts.append(
        f'<line class="axis axis-y" x1="{p.left}" y1="{p.top}" x2="{p.left}" y2="{_f(p.base)}">'
        f'</line><line class="axis axis-x" x1="{p.left}" y1="{_f(p.base)}" '
        f'x2="{p.width - p.right}" y2="{_f(p.base)}"></line>'
        f'<text class="axis-title axis-title-y" x="4" y="{p.top - 10}">'
        f"{esc(y_title)}</text>"
        f'<text class="axis-title axis-title-x" x="{p.width - p.right}" y="{p.height - 2}">'
        "time (UTC)</text>"
    )
    return "".join(parts)


def _svg(p: Plot, chart_id: str, label: str, body: str, *, cls: str = "chart") -> str:
    return (
        f'<svg class="{cls}" id="{esc(chart_id)}" viewBox="0 0 {p.width} {p.height}" '
        f'width="{p.width}" height="{p.height}" role="img" aria-label="{esc(label, 500)}" '
        f'data-y-max="{p.y_max:g}" data-plot-top="{p.top}" data-plot-bottom="{_f(p.base)}" '
        f'data-plot-left="{p.left}" data-plot-right="{p.width - p.right}" '
        f'data-start="{_iso(p.start)}" data-end="{_iso(p.end)}">{body}</svg>'
    )


def legend(items: Iterable[tuple[str, str]]) -> str:
    """The words for a chart's colours: (css key, label) pairs."""
    return (
        '<ul class="legend">'
        + "".join(f'<li><span class="key key-{k}"></span>{esc(label)}</li>' for k, label in items)
        + "</ul>"
    )


def throughput_chart(tp: Throughput) -> str:
    """Tasks done and failed for good per minute over the window, as stacked bars."""
    start = tp.start or datetime.now(UTC).replace(second=0, microsecond=0)
    end = start + timedelta(minutes=MINUTES)
    top, step = nice_top(max((m.done + m.failed for m in tp.minutes), default=0), whole=True)
    p = Plot(start, end, top)
    slot = p.inner_width / MINUTES
    bars = []
    for m in tp.minutes:
        x = p.x(m.at) + 0.5
        done_h = m.done / top * p.inner_height
        failed_h = m.failed / top * p.inner_height
        tip = f"{_hhmm(m.at)} UTC: {m.done:,} done, {m.failed:,} failed"
        bars.append(
            f'<g class="bar" data-minute="{_iso(m.at)}" data-done="{m.done}" '
            f'data-failed="{m.failed}"><title>{esc(tip)}</title>'
            f'<rect class="fill-done" x="{_f(x)}" y="{_f(p.base - done_h)}" '
            f'width="{_f(slot - 1)}" height="{_f(done_h)}"></rect>'
            f'<rect class="fill-failed" x="{_f(x)}" y="{_f(p.base - done_h - failed_h)}" '
            f'width="{_f(slot - 1)}" height="{_f(failed_h)}"></rect></g>'
        )
    body = _axes(p, step, "tasks / minute", count_label, 10) + "".join(bars)
    label = "Tasks finished per minute over the last hour: done and failed"
    return _svg(p, "chart-throughput", label, body) + legend(
        (("done", "done"), ("failed", "failed for good"))
    )


def _line(p: Plot, key: str, points: Sequence[tuple[datetime, float]]) -> str:
    """A line through ``points`` (at, value), broken where samples are missing."""
    lines, run = [], []
    previous: datetime | None = None
    for at, value in points:
        if previous is not None and at - previous > GAP and run:
            lines.append(run)
            run = []
        run.append(f"{_f(p.x(at))},{_f(p.y(value))}")
        previous = at
    if run:
        lines.append(run)
    return "".join(
        f'<polyline class="line line-{key}" points="{" ".join(r)}"></polyline>'
        for r in lines
        if len(r) > 1
    )


def _marks(p: Plot, at: datetime, values: dict[str, float], tip: str, attrs: dict[str, str]) -> str:
    """The dots of one moment, one per series (``values`` by series key), with their figures as
    data attributes (``data-KEY``) and one tooltip."""
    data = "".join(f' data-{k}="{esc(v)}"' for k, v in attrs.items())
    dots = "".join(
        f'<circle class="pt pt-{k}" cx="{_f(p.x(at))}" cy="{_f(p.y(v))}" r="2.5"></circle>'
        for k, v in values.items()
    )
    return f'<g class="mark" data-at="{_iso(at)}"{data}><title>{esc(tip, 500)}</title>{dots}</g>'


def _empty(p: Plot, text: str) -> str:
    x = p.left + p.inner_width / 2
    y = p.top + p.inner_height / 2
    return f'<text class="empty" x="{_f(x)}" y="{_f(y)}">{esc(text)}</text>'


def depth_chart(trends: Trends) -> str:
    """The fleet's tasks due and waiting (queued) and running, a minute at a time."""
    end = trends.end or datetime.now(UTC).replace(second=0, microsecond=0)
    start = trends.start or end - timedelta(minutes=MINUTES)
    shown = [d for d in trends.depth if start <= d.at <= end]
    top, step = nice_top(max((max(d.queued, d.in_progress) for d in shown), default=0), whole=True)
    p = Plot(start, end, top)
    body = _axes(p, step, "tasks", count_label, 10)
    if not shown:
        body += _empty(p, "no minute recorded in the last hour")
    body += _line(p, "queued", [(d.at, d.queued) for d in shown])
    body += _line(p, "in_progress", [(d.at, d.in_progress) for d in shown])
    for d in shown:
        mark = "≥" if d.queued_capped else ""
        tip = f"{when(d.at)}: {mark}{d.queued:,} queued, {d.in_progress:,} in progress"
        body += _marks(
            p,
            d.at,
            {"queued": d.queued, "in_progress": d.in_progress},
            tip,
            {"queued": f"{mark}{d.queued}", "in-progress": str(d.in_progress)},
        )
    label = "Tasks queued (due, waiting) and in progress, sampled once a minute, last hour"
    return _svg(p, "chart-depth", label, body) + legend(
        (("queued", "queued (due, waiting)"), ("in_progress", "in progress"))
    )


def _wait_chart(queue: str, index: int, waits: list[Wait], start: datetime, end: datetime) -> str:
    top, step = nice_top(max((w.p99 for w in waits), default=0.0))
    p = Plot(start, end, top, width=380, height=160, left=52, right=10, top=22, bottom=30)
    half = timedelta(seconds=30)
    body = (
        _axes(p, step, "wait", seconds_label, 20)
        + _line(p, "p50", [(w.minute + half, w.p50) for w in waits])
        + _line(p, "p99", [(w.minute + half, w.p99) for w in waits])
    )
    for w in waits:
        tip = (
            f"{_hhmm(w.minute)} UTC, {w.tasks:,} task(s) finished: p50 {seconds_label(w.p50)}, "
            f"p99 {seconds_label(w.p99)}"
        )
        body += _marks(
            p,
            w.minute + half,
            {"p50": w.p50, "p99": w.p99},
            tip,
            {"tasks": str(w.tasks), "p50": f"{w.p50:g}", "p99": f"{w.p99:g}"},
        )
    last = waits[-1]
    caption = (
        f"<figcaption><b>{esc(queue, 80)}</b> <span>last: p50 {esc(seconds_label(last.p50))}, "
        f"p99 {esc(seconds_label(last.p99))} ({_hhmm(last.minute)} UTC)</span></figcaption>"
    )
    label = f"Wait time of queue {queue[:80]}: p50 and p99 per minute, last hour"
    return (
        f'<figure class="mini" data-wait-queue="{esc(queue)}">{caption}'
        + _svg(p, f"chart-wait-{index}", label, body, cls="chart mini")
        + "</figure>"
    )


def wait_charts(trends: Trends) -> str:
    """For each of the busiest queues, the median and 99th percentile wait per minute."""
    end = trends.end or datetime.now(UTC).replace(second=0, microsecond=0)
    start = trends.start or end - timedelta(minutes=MINUTES)
    charts = [
        _wait_chart(queue, i, waits, start, end)
        for i, (queue, waits) in enumerate(trends.waits.items())
        if waits
    ]
    if not charts:
        return '<p class="empty-note">No finished task was measured in the last hour.</p>'
    return (
        '<div class="minis" id="chart-waits">'
        + "".join(charts)
        + "</div>"
        + legend((("p50", "p50 (median)"), ("p99", "p99")))
    )


__all__ = [
    "Plot",
    "count_label",
    "depth_chart",
    "legend",
    "nice_top",
    "seconds_label",
    "throughput_chart",
    "wait_charts",
]
