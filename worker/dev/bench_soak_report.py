"""What `worker bench --soak` concludes and prints (see bench_soak): five-minute blocks, the
verdicts (the last minutes against the first, the hold against the minutes before it), and the
table of minutes.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from .bench_soak_probes import PROGRESS_SECONDS, ratio, summary

WINDOW = 5  # minutes compared at the start and the end, and minutes per block


def _pooled(waits: list[list[float]], start: int, stop: int) -> dict[str, Any]:
    return summary([w for minute in waits[start:stop] for w in minute])


def blocks(rows: list[dict[str, Any]], waits: list[list[float]]) -> list[dict[str, Any]]:
    """Five minutes at a time: latency over all their samples, the rest summed or at the end."""
    out = []
    for i in range(0, len(rows), WINDOW):
        part = rows[i : i + WINDOW]
        tasks = sum(r["tasks"] for r in part)
        wal = [r["wal_bytes_per_task"] * r["tasks"] for r in part if r["wal_bytes_per_task"]]
        cpu = [r["db_cpu_ms_per_task"] * r["tasks"] for r in part if r["db_cpu_ms_per_task"]]
        out.append(
            {
                "minutes": f"{i + 1}-{i + len(part)}",
                "tasks": tasks,
                **_pooled(waits, i, i + WINDOW),
                "total_mb_at_end": part[-1]["total_mb"],
                "dead_rows_at_end": part[-1]["dead_rows"],
                "autovacuum_runs": sum(r["autovacuum_runs"] for r in part),
                "autovacuum_seconds": round(sum(r["autovacuum_seconds"] for r in part), 1),
                "wal_bytes_per_task": round(sum(wal) / tasks) if tasks and wal else None,
                "db_cpu_ms_per_task": round(sum(cpu) / tasks, 3) if tasks and cpu else None,
            }
        )
    return out


def verdict(rows: list[dict[str, Any]], waits: list[list[float]]) -> dict[str, Any]:
    n = len(rows)
    w = max(1, min(WINDOW, n // 2))
    first, last = _pooled(waits, 0, w), _pooled(waits, n - w, n)
    size_first, size_end = rows[w - 1]["total_mb"], rows[-1]["total_mb"]
    p99 = ratio(last["p99_ms"], first["p99_ms"])
    size = ratio(rows[-1]["total_bytes"], rows[w - 1]["total_bytes"])
    return {
        "window_minutes": w,
        "first": first,
        "last": last,
        "p99_ratio": p99,
        "p99_target": f"p99 of the last {w} minute(s) <= 1.5 x the first {w}",
        "p99_met": None if p99 is None else p99 <= 1.5,
        "size_after_first_mb": size_first,
        "size_end_mb": size_end,
        "size_ratio": size,
        "size_target": f"table size at the end <= 2 x after the first {w} minute(s)",
        "size_met": None if size is None else size <= 2.0,
    }


def held_verdict(
    rows: list[dict[str, Any]], waits: list[list[float]], start: int, minutes: int
) -> dict[str, Any]:
    before, held = _pooled(waits, 0, start), _pooled(waits, start, start + minutes)
    p99 = ratio(held["p99_ms"], before["p99_ms"])
    return {
        "minutes": minutes,
        "from_minute": start + 1,
        "to_minute": start + minutes,
        "before": before,
        "held": held,
        "p99_ratio": p99,
        "target": "p99 during the hold <= 2 x the minutes before it",
        "target_met": None if p99 is None else p99 <= 2.0,
        "dead_rows_at_end_of_hold": rows[start + minutes - 1]["dead_rows"],
    }


# -- the report ------------------------------------------------------------------------------------

_COLUMNS = (
    ("min", "minute", "{}"),
    ("tasks", "tasks", "{:,}"),
    ("p50 ms", "p50_ms", "{:.1f}"),
    ("p99 ms", "p99_ms", "{:.1f}"),
    ("heap MB", "heap_mb", "{:,.1f}"),
    ("index MB", "index_mb", "{:,.1f}"),
    ("hist MB", "history_mb", "{:,.1f}"),
    ("dead rows", "dead_rows", "{:,}"),
    ("autovac", "autovacuum_runs", "{}"),
    ("av s", "autovacuum_seconds", "{:.1f}"),
    ("vac", "vacuum_runs", "{}"),
    ("WAL B/task", "wal_bytes_per_task", "{:,.0f}"),
    ("CPU ms/task", "db_cpu_ms_per_task", "{:.3f}"),
    ("backlog", "backlog", "{:,}"),
)


def print_minute(row: dict[str, Any], *, header: bool, out: TextIO = sys.stdout) -> None:
    """One line per minute as it ends (on stderr with --json, whose stdout is the report)."""
    if header:
        print("  " + "  ".join(f"{h:>{_width(h)}}" for h, _, _ in _COLUMNS), file=out, flush=True)
    cells = []
    for h, key, fmt in _COLUMNS:
        value = row[key]
        text = "-" if value is None else fmt.format(value)
        cells.append(f"{text:>{_width(h)}}")
    print("  " + "  ".join(cells) + ("  held" if row["held"] else ""), file=out, flush=True)


def _width(head: str) -> int:
    return max(len(head), 7)


def _verdict_word(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def print_summary(s: dict[str, Any]) -> None:
    if len(s["blocks"]) > 1:
        print(f"  per {WINDOW} minutes:")
        for b in s["blocks"]:
            wal, cpu = b["wal_bytes_per_task"], b["db_cpu_ms_per_task"]
            print(
                f"    {b['minutes']:>7}  p50 {b['p50_ms']} ms, p99 {b['p99_ms']} ms; table "
                f"{b['total_mb_at_end']:,.1f} MB, {b['dead_rows_at_end']:,} dead rows at the "
                f"end; autovacuum {b['autovacuum_runs']} run(s), {b['autovacuum_seconds']} s; "
                f"WAL {'-' if wal is None else f'{wal:,}'} B/task, database CPU "
                f"{'-' if cpu is None else cpu} ms/task"
            )
    v = s["verdict"]
    w = v["window_minutes"]
    print(
        f"  p99, first {w} minute(s) {v['first']['p99_ms']} ms, last {w} "
        f"{v['last']['p99_ms']} ms: x{v['p99_ratio']}; target {v['p99_target']}: "
        f"{_verdict_word(v['p99_met'])}"
    )
    print(
        f"  table size after {w} minute(s) {v['size_after_first_mb']} MB, at the end "
        f"{v['size_end_mb']} MB: x{v['size_ratio']}; target {v['size_target']}: "
        f"{_verdict_word(v['size_met'])}"
    )
    runs = [r["seconds"] for r in s["autovacuums"]]
    if runs:
        print(
            f"  autovacuum of the table seen running {len(runs)} time(s), longest "
            f"{max(runs):.1f} s, {sum(runs):.1f} s in all (sampled every {PROGRESS_SECONDS} s)"
        )
    h = s["hold"]
    if h:
        print(
            f"  held transaction, minutes {h['from_minute']}-{h['to_minute']}: p99 "
            f"{h['held']['p99_ms']} ms against {h['before']['p99_ms']} ms before it: "
            f"x{h['p99_ratio']}; target {h['target']}: {_verdict_word(h['target_met'])}"
        )
