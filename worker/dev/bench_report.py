"""The text report of ``worker bench`` (its ``--json`` form is the dict ``bench.run`` returns)."""

from __future__ import annotations

from typing import Any

from . import bench_flows


def _row(label: str, r: dict[str, Any]) -> None:
    cpu = r["db_cpu_ms_per_task"]
    cost = "" if cpu is None else f", database CPU {cpu:.2f} ms/task"
    print(
        f"    {label:<20}  p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
        f"max {r['max_ms']:.1f} ms{cost}"
    )


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def print_report(r: dict[str, Any]) -> None:
    print(
        f"worker bench: {r['tasks']} no-op tasks, batch {r['batch_size']}, "
        f"{r['processes']} process(es) x {r['concurrency']} slots, {r['cpus']} CPUs, "
        f"PostgreSQL {r['server']} (fsync={r['fsync']}, synchronous_commit="
        f"{r['synchronous_commit']})"
    )
    if r["finished_rows"] or r["held_transaction"]:
        held = ", another session holding a transaction open" if r["held_transaction"] else ""
        where = "the history" if r.get("keep_history") else "the table"
        print(f"  with {r['finished_rows']:,} finished rows in {where}{held}")
    if r["metrics"]:
        print("  with metrics on (counting, and the journal under a supervisor)")
    conns = f"{r['ceiling_connections']} connection(s)"
    print(f"  ceiling (bare SQL)      {r['ceiling']:>9,} tasks/s   {conns}, ack+claim per commit")
    for label, rate, ratio in (
        ("enqueue_many (COPY)", r["enqueue_per_s"], r["enqueue_ratio"]),
        ("drain (worker)", r["drain_per_s"], r["drain_ratio"]),
    ):
        print(f"  {label:<22}  {rate:>9,} tasks/s   {ratio:.0%} of the ceiling")
    print(f"    target {r['drain_target']}: {_verdict(r['drain_target_met'])}")
    w = r["wal_per_task"]
    print(
        f"  WAL per task            {w['drain_bytes']:>9,} B (drain), {w['ceiling_bytes']:,} B"
        f" (ceiling), x{w['ratio']}"
    )
    print(f"    target {w['target']}: {_verdict(w['target_met'])}")
    print(f"  worker peak RSS         {r['worker_max_rss_mb']:>9} MB per process")
    if r["limits"]:
        lim = r["limits"]
        for kind, label in (("concurrency", "concurrency limit"), ("rate", "rate limit")):
            d = lim[kind]
            print(
                f"  drain, {label + ' (non-binding)':<30} {d['drain_per_s']:>9,} tasks/s   "
                f"{d['ratio']:.0%} of the unlimited drain"
            )
        print(f"    target {lim['target']}: {_verdict(lim['target_met'])}")
    if r["latency"]:
        lat = r["latency"]
        print(f"  latency, enqueue to claim, {lat['rate_per_s']:,.0f} tasks/s one per commit:")
        _row("empty table", lat)
    if r["light_delayed"]:
        d = r["light_delayed"]
        print(f"  light_delayed, {d['rate_per_s']:,.0f} tasks/s one per commit:")
        _row("empty table", d["base"])
        _row(f"{d['delayed_rows']:,} delayed", d["backlog"])
        print(f"    p99 x{d['p99_ratio']}; target {d['target']}: {_verdict(d['target_met'])}")
    if r["many_queues"]:
        m = r["many_queues"]
        print(f"  many_queues, {m['rate_per_s']:,.0f} tasks/s one per commit into q0:")
        _row("serving q0 alone", m["one"])
        _row(f"serving {m['served_queues']:,} queues", m["many"])
        cost = "?" if m["cost_ratio"] is None else f"x{m['cost_ratio']}"
        verdict = _verdict(m["target_met"])
        print(f"    p99 x{m['p99_ratio']}, cost {cost}; target {m['target']}: {verdict}")
    if r["light_held"]:
        h = r["light_held"]
        print(f"  light_held, {h['rate_per_s']:,.0f} tasks/s one per commit:")
        _row("no transaction held", h["base"])
        _row(f"held {h['held_seconds']:,.0f} s", h["held"])
        print(f"    p99 x{h['p99_ratio']}; target {h['target']}: {_verdict(h['target_met'])}")
    if r["workflows"]:
        bench_flows.print_report(r["workflows"], _verdict)


__all__ = ["print_report"]
