"""The composition matrix: every pair of features under every fault, with real worker processes.

A case is one pair of features (``FEATURES``) under one fault (``FAULTS``): its tasks run on real
processes (`worker run` with a supervisor and two children; `manage.py worker_run` for Django
tasks; an application process with a worker.BackgroundWorker for the in-process worker), the
fault strikes while tasks run, a second fleet takes over where the first is gone, and once every
task has settled the case checks, with the same helpers for every case (``check_promises``),
each promise that applies:

- never lost: every enqueued task ends done, or cancelled/failed/deleted where the case did that
  on purpose (``check_never_lost``);
- never two attempts at once: no two runs of one task overlap, except when the earlier one is on a
  SIGSTOPped process whose lease lapsed and was taken over; and then its late acknowledgement is
  fenced: nothing it sends changes the row, whose end comes from the new attempt
  (``check_one_attempt_at_a_time``, ``check_done_comes_from_its_attempt``,
  ``check_finished_rows_stay_finished``);
- paused means no start while paused: no claim of the queue between the pause's commit and the
  resume (``check_paused``);
- limits never exceeded: at most ``CONCURRENCY`` runs of the queue and ``KEY_CONCURRENCY`` of a key
  at once by the database clock, counting a run while its lease holds (as the claim counts it);
  at most ``RATE`` + burst - 1 handler starts in any one-second window (``check_limits``);
- cancelled never done: a row with a cancel request never ends done nor goes back to the queue
  (``check_cancels``);
- a workflow's join is released once, after its inputs all ended done, and runs with their
  results in order; a cancelled input cancels it (``check_workflow``);
- plus what each feature promises of its own (results, side effects of transactional handlers,
  typed payloads, bulk actions, where the tasks ran).

The evidence: handlers record every run in ``mx_runs`` (tests/matrix_module.py), a trigger
records every change of every task row in ``mx_log`` (state, attempt, owner, lease, cancel mark,
clock_timestamp() and statement_timestamp()), and the test records when it signalled, killed or
froze which process, and when a pause held.

How many cases run:

- by default a sample, one case per fault with a pair drawn by a seed (about 90 s in all). The
  seed is in every test id (``seed123-pause+rate:sigstop``); ``WORKER_MATRIX_SEED=123`` draws the
  same cases again (``WORKER_MATRIX_SAMPLE=N`` draws N cases instead of one per fault);
- ``WORKER_MATRIX=all``: every pair under every fault (the nightly size, about an hour);
- ``WORKER_MATRIX_CASES=pause+rate:sigstop,results+django:db-restart``: the cases named.

A pair that makes no sense, or a fault that has no target for it, is in ``EXCLUDED`` with why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from conftest import ROOT, run_cli
from matrix_module import MxPayload, task_name

import worker
from worker.db.migrate import migrate
from worker.dev.embedded import EmbeddedPostgres

# -- the table ----------------------------------------------------------------------------------

N_TASKS = 14  # the case's tasks, each working SLEEP seconds but the first LONG, LONG_SLEEP
SLEEP = 0.8
LONG = 2  # so that tasks still run when the fault strikes, even in a queue paused just before
LONG_SLEEP = 4.0
PROCESSES = 2  # worker processes in a fleet
SLOTS = 3  # --concurrency of each
CONCURRENCY = 3  # the concurrency limit
KEYS = 4
KEY_CONCURRENCY = 1
RATE = 5  # starts per second
BURST = 1  # the default burst: a one-second window holds at most RATE + BURST - 1 starts
LEASE = 3.0
LEASE_DB_RESTART = 8.0  # the outage (stop and start, 1-3 s) must stay well inside a lease
SETTLE_TIMEOUT = 90.0
FINAL = ("done", "failed", "cancelled")

FEATURES = {
    "pause": "`worker pause mx` while tasks run, `worker resume mx` after the fault",
    "concurrency": f"`worker limits set mx --concurrency {CONCURRENCY}`",
    "key-limit": f"tasks keyed k0..k{KEYS - 1},"
    f" `worker limits set mx --key-concurrency {KEY_CONCURRENCY}`",
    "rate": f"`worker limits set mx --rate {RATE}/s`",
    "cancel": "`worker cancel ID` of a running task, sent as the fault strikes",
    "bulk": "`worker cancel --ids ... --yes` (queued, scheduled and a running one), then "
    "`worker retry --ids ... --state cancelled --yes`, then `worker delete --ids ... --yes`",
    "results": "handlers return a value, stored with the row (store_result=True)",
    "django": "Django tasks (tests/django_site/matrix_tasks.py) enqueued by Django, run by "
    "`manage.py worker_run`",
    "inproc": "the tasks run on a worker.BackgroundWorker in an application's own process "
    "(tests/matrix_app.py), stopped by the application on SIGTERM",
    "transactional": "transactional=True handlers writing a side effect on ctx.conn",
    "typed": "a dataclass payload (and one row written by SQL that does not fit it)",
    "workflow": "the tasks are one workflow (worker.group): all but the last in parallel, the "
    "last a join that runs once they are all done, with their results in order",
}

FAULTS = {
    "sigterm": "graceful stop (SIGTERM) of the whole fleet, then a new fleet",
    "kill-child": "SIGKILL of one worker process that is running a task (a supervisor's child; "
    "one of the two `manage.py worker_run` or application processes)",
    "kill-supervisor": "SIGKILL of the `worker run` supervisor (its children die with it), then "
    "a new fleet",
    "sigstop": "SIGSTOP of one worker process running a task for two leases, then SIGCONT",
    "db-restart": "the embedded server stopped and started again on the same port",
    "held-xact": "a session holding an open transaction (its snapshot holds the xmin horizon, "
    "with a transaction id) from the fault until every task has settled",
}

# (features the exclusion applies to, fault or None for every fault, why)
EXCLUDED: list[tuple[frozenset[str], str | None, str]] = [
    (
        frozenset({"django", "key-limit"}),
        None,
        "a Django task's enqueue gives its row no limit key (Django's API has none), so a "
        "per-key limit has no key to count",
    ),
    (
        frozenset({"django", "transactional"}),
        None,
        "the Django backend has no transactional handlers: a Django task uses Django's own "
        "transaction.atomic() on Django's connection",
    ),
    (
        frozenset({"django", "typed"}),
        None,
        "Django tasks take Django's args and kwargs; typed payloads are an option of "
        "@worker.task only",
    ),
    (
        frozenset({"django", "workflow"}),
        None,
        "Django's Tasks API has no workflows: a workflow's steps are @worker.task handlers",
    ),
    (
        frozenset({"django"}),
        "kill-supervisor",
        "`manage.py worker_run` is one process with no supervisor: killing it is kill-child",
    ),
    (
        frozenset({"inproc"}),
        "kill-supervisor",
        "an application's BackgroundWorker has no supervisor: killing its process is kill-child",
    ),
]


@dataclasses.dataclass(frozen=True)
class Case:
    features: tuple[str, str]
    fault: str

    @property
    def name(self) -> str:
        return f"{'+'.join(self.features)}:{self.fault}"

    def has(self, feature: str) -> bool:
        return feature in self.features


def excluded(features: tuple[str, str], fault: str) -> str | None:
    for which, only, why in EXCLUDED:
        if which <= set(features) and only in (None, fault):
            return why
    return None


def all_cases() -> list[Case]:
    names = list(FEATURES)
    return [
        Case(pair, fault)
        for pair in itertools.combinations(names, 2)
        for fault in FAULTS
        if excluded(pair, fault) is None
    ]


def parse_case(text: str) -> Case:
    pair, _, fault = text.strip().partition(":")
    a, _, b = pair.partition("+")
    if fault not in FAULTS or a not in FEATURES or b not in FEATURES or a == b:
        raise ValueError(
            f"WORKER_MATRIX_CASES: {text!r} is not FEATURE+FEATURE:FAULT with features from "
            f"{sorted(FEATURES)} and faults from {sorted(FAULTS)}"
        )
    names = list(FEATURES)
    features = tuple(sorted((a, b), key=names.index))
    why = excluded(features, fault)  # type: ignore[arg-type]
    if why:
        raise ValueError(f"WORKER_MATRIX_CASES: {text!r} is excluded: {why}")
    return Case(features, fault)  # type: ignore[arg-type]


def matrix_seed() -> int:
    """WORKER_MATRIX_SEED, else one drawn for the run: under pytest-xdist from the run's id,
    which every test process shares (they must collect the same cases)."""
    if os.environ.get("WORKER_MATRIX_SEED"):
        return int(os.environ["WORKER_MATRIX_SEED"])
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:
        return int(run[:8], 16) % 1_000_000
    return random.SystemRandom().randrange(1_000_000)


def selected_cases(seed: int) -> list[Case]:
    every = all_cases()
    if os.environ.get("WORKER_MATRIX_CASES"):
        return [parse_case(t) for t in os.environ["WORKER_MATRIX_CASES"].split(",") if t.strip()]
    if os.environ.get("WORKER_MATRIX", "").lower() == "all":
        return every
    size = int(os.environ.get("WORKER_MATRIX_SAMPLE", "0") or 0)
    if size <= 0:
        return random_sample(seed)
    return random.Random(seed).sample(every, min(size, len(every)))


def random_sample(seed: int) -> list[Case]:
    """One case per fault, each with a pair drawn by the seed."""
    rng = random.Random(seed)
    every = all_cases()
    return [rng.choice([c for c in every if c.fault == fault]) for fault in FAULTS]


SEED = matrix_seed()
CASES = selected_cases(SEED)


# -- the server and the instruments ---------------------------------------------------------------


@pytest.fixture(scope="module")
def matrix_server() -> Iterator[EmbeddedPostgres]:
    """A server of the matrix's own: the db-restart cases stop and start it, and the held
    transactions hold its xmin horizon, not the session's. Its data is outside pytest's temporary
    folder: every pytest session that starts on the machine sets that folder's mode back to 0700,
    after which the server's own user could no longer reach its data to stop and start."""
    folder = Path(tempfile.mkdtemp(prefix="worker-matrix-"))
    folder.chmod(0o755)
    server = EmbeddedPostgres(folder / "pgdata", durable=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


INSTRUMENTS = """
CREATE TABLE {s}.mx_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, task_id bigint, attempt int,
    worker_id text, pid int, kind text, typed text, wall double precision, inputs jsonb,
    started timestamptz, finished timestamptz, outcome text, late_start bool, late_end bool);
CREATE TABLE {s}.mx_effects (task_id bigint, attempt int, worker_id text);
CREATE TABLE {s}.mx_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, op text, task_id bigint,
    old_state text, new_state text, old_attempts int, new_attempts int,
    old_worker text, new_worker text, lease timestamptz, old_mark bool, new_mark bool,
    at timestamptz, stmt timestamptz, app text, moment timestamptz, settled bool);
CREATE FUNCTION {s}.mx_log_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {s}.mx_log (op, task_id, new_state, new_attempts, new_worker, lease,
                                new_mark, at, stmt, app)
        VALUES ('insert', NEW.id, NEW.state, NEW.attempts, NEW.worker_id, NEW.lease_expires_at,
                NEW.cancel_requested_at IS NOT NULL, clock_timestamp(), statement_timestamp(),
                current_setting('application_name'));
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO {s}.mx_log (op, task_id, old_state, old_attempts, old_worker, old_mark,
                                at, stmt, app)
        VALUES ('delete', OLD.id, OLD.state, OLD.attempts, OLD.worker_id,
                OLD.cancel_requested_at IS NOT NULL, clock_timestamp(), statement_timestamp(),
                current_setting('application_name'));
    ELSE
        INSERT INTO {s}.mx_log (op, task_id, old_state, new_state, old_attempts, new_attempts,
                                old_worker, new_worker, lease, old_mark, new_mark, at, stmt, app,
                                moment, settled)
        VALUES ('update', NEW.id, OLD.state, NEW.state, OLD.attempts, NEW.attempts,
                OLD.worker_id, NEW.worker_id, NEW.lease_expires_at,
                OLD.cancel_requested_at IS NOT NULL, NEW.cancel_requested_at IS NOT NULL,
                clock_timestamp(), statement_timestamp(), current_setting('application_name'),
                NEW.started_at, OLD.dependents AND NOT NEW.dependents);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER mx_log AFTER INSERT OR UPDATE OR DELETE ON {s}.tasks
    FOR EACH ROW EXECUTE FUNCTION {s}.mx_log_row();
"""


def _ts(value: Any) -> float | None:
    return None if value is None else value.timestamp()


# -- the evidence -------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    id: int
    task_id: int
    attempt: int
    worker_id: str
    pid: int
    kind: str
    typed: str
    wall: float
    start: float
    finished: float | None
    outcome: str | None
    late: bool
    end: float = 0.0  # finished, or when its process was gone (see Evidence.run_end)
    inputs: list[Any] | None = None  # a workflow step's ctx.inputs


@dataclasses.dataclass
class Claim:
    """One claim of a row, from its claim until the row left it (acknowledged, handed back,
    rescued): the lease writes on the way say when it was live."""

    task_id: int
    attempt: int
    worker_id: str
    at: float
    stmt: float
    leases: list[tuple[float, float]]  # (when written, until)
    out: float | None = None
    out_state: str | None = None
    moment: float | None = None  # started_at as the claim set it: a rate limit's paced moment

    def live(self) -> list[tuple[float, float]]:
        spans = []
        for i, (at, until) in enumerate(self.leases):
            nxt = self.leases[i + 1][0] if i + 1 < len(self.leases) else float("inf")
            end = min(until, nxt, self.out if self.out is not None else float("inf"))
            if end > at:
                spans.append((at, end))
        return spans

    def lapsed_before_out(self) -> bool:
        return self.out is not None and self.leases[-1][1] <= self.out


@dataclasses.dataclass
class Evidence:
    case: Case
    seed: int
    enqueued: dict[int, str]  # task id -> limit key ('' without)
    options: set[str]  # handler options: results, tx, typed
    runs: list[Run]
    log: list[dict[str, Any]]
    rows: dict[int, dict[str, Any]]  # the task rows left at the end
    effects: list[tuple[int, int, str]]
    deaths: dict[int, float]  # pid -> when it was seen gone (it died at or before)
    faulted_at: float
    stopped: dict[int, tuple[float, float]]  # pid -> (SIGSTOP, SIGCONT)
    pauses: list[tuple[float, float]]  # (after the pause committed, before the resume)
    limits: dict[str, int]
    cancel: dict[str, Any]  # the cancel feature: target id, outcome
    bulk: dict[str, Any]  # the bulk feature: ids asked, cancelled, retried, deleted
    bad_typed: int | None
    kind: str
    fleet_pids: set[int]
    notes: list[str]
    flow: dict[str, Any] = dataclasses.field(default_factory=dict)  # the workflow: inputs, join

    def __post_init__(self) -> None:
        self.claims: dict[int, list[Claim]] = defaultdict(list)
        self.by_task: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for entry in self.log:
            self.by_task[entry["task_id"]].append(entry)
        for task_id, entries in self.by_task.items():
            current: Claim | None = None
            for e in entries:
                if e["op"] == "update" and e["new_state"] == "in_progress":
                    same = (
                        current is not None
                        and e["old_state"] == "in_progress"
                        and (e["new_attempts"], e["new_worker"])
                        == (current.attempt, current.worker_id)
                    )
                    if same:
                        assert current is not None
                        current.leases.append((e["at"], e["lease"]))
                        continue
                    if current is not None and current.out is None:
                        current.out, current.out_state = e["at"], "in_progress"
                    current = Claim(
                        task_id,
                        e["new_attempts"],
                        e["new_worker"],
                        e["at"],
                        e["stmt"],
                        [(e["at"], e["lease"])],
                        moment=e.get("moment"),
                    )
                    self.claims[task_id].append(current)
                elif (
                    e["old_state"] == "in_progress" and current is not None and current.out is None
                ):
                    current.out = e["at"]
                    current.out_state = e["new_state"] or "deleted"
        for run in self.runs:
            run.end = self.run_end(run)

    def claim_of(self, run: Run) -> Claim | None:
        found = [
            c
            for c in self.claims.get(run.task_id, [])
            if c.attempt == run.attempt and c.worker_id == run.worker_id and c.at <= run.start
        ]
        return found[-1] if found else None

    def run_end(self, run: Run) -> float:
        """When a run ended: its handler's own record, else (its process died with it) when the
        process was seen gone, or earlier, when its row left it after the fault (a dead process's
        row is handed back or rescued only once it is dead)."""
        if run.finished is not None:
            return run.finished
        gone = self.deaths.get(run.pid, float("inf"))
        claim = self.claim_of(run)
        if claim is not None and claim.out is not None and claim.out >= self.faulted_at:
            return min(gone, claim.out)
        return gone

    def counted(self, run: Run) -> list[tuple[float, float]]:
        """The spans in which the run counts against a limit: while it runs under a live lease."""
        claim = self.claim_of(run)
        if claim is None:
            return [(run.start, run.end)]
        spans = []
        for a, b in claim.live():
            lo, hi = max(a, run.start), min(b, run.end)
            if hi > lo:
                spans.append((lo, hi))
        return spans

    def describe(self, run: Run) -> str:
        claim = self.claim_of(run)
        state = "stopped " if run.pid in self.stopped else ""
        return (
            f"run {run.id} of task {run.task_id} attempt {run.attempt} by {state}pid {run.pid}"
            f" ({run.kind}, worker {run.worker_id[:8]}): {_t(run.start)} .. {_t(run.end)}"
            f"{' (late record)' if run.late else ''}"
            + (
                f"; its claim at {_t(claim.at)}, lease last until {_t(claim.leases[-1][1])},"
                f" row left it at {_t(claim.out)} ({claim.out_state})"
                if claim
                else "; NO CLAIM MATCHES IT"
            )
        )

    def history(self, task_id: int) -> str:
        lines = []
        for e in self.by_task.get(task_id, []):
            lines.append(
                f"  {_t(e['at'])} {e['op']} {e['old_state']}->{e['new_state']}"
                f" attempt {e['old_attempts']}->{e['new_attempts']}"
                f" worker {str(e['old_worker'])[:8]}->{str(e['new_worker'])[:8]}"
                f" lease {_t(e['lease'])} mark {e['old_mark']}->{e['new_mark']} ({e['app']})"
            )
        runs = [self.describe(r) for r in self.runs if r.task_id == task_id]
        return "\n".join(lines + ["  " + r for r in runs])


_T0 = [0.0]


def _t(value: float | None) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "inf"
    return f"{value - _T0[0]:.3f}s"


# -- the checks, shared by every case -------------------------------------------------------------


class Broken(AssertionError):
    pass


def _fail(ev: Evidence, promise: str, detail: str) -> None:
    raise Broken(
        f"{ev.case.name} broke '{promise}'\n{detail}\n"
        f"(times from the case's start; reproduce with WORKER_MATRIX_CASES={ev.case.name}"
        f" WORKER_MATRIX_SEED={ev.seed})"
    )


def expected_ends(ev: Evidence) -> dict[int, set[str]]:
    """The end each enqueued task may have: done, unless the case cancelled it on purpose (the
    cancel target, the bulk action's), or it is the typed payload's misfit row."""
    ends = {task_id: {"done"} for task_id in ev.enqueued}
    target = ev.cancel.get("target")
    if target is not None:
        granted = ev.cancel.get("outcome") in ("requested", "cancelled")
        ends[target] = {"cancelled"} if granted else {"done"}
    for task_id in ev.bulk.get("deleted", []):
        ends[task_id] = {"deleted"}
    if ev.bad_typed is not None:
        ends[ev.bad_typed] = {"failed"}
    if ev.flow and any(ends[t] == {"cancelled"} for t in ev.flow["inputs"]):
        ends[ev.flow["join"]] = {"cancelled"}  # its input was cancelled for good
    return ends


def check_never_lost(ev: Evidence) -> None:
    """Every enqueued task ends as the case meant: done, or cancelled, failed or deleted where it
    did so on purpose; none is still queued or running once the case has settled."""
    ends = expected_ends(ev)
    wrong = []
    for task_id, allowed in sorted(ends.items()):
        row = ev.rows.get(task_id)
        state = row["state"] if row else "deleted"
        if state not in allowed:
            error = (row or {}).get("last_error") or ""
            wrong.append(f"task {task_id}: {state} (expected {'/'.join(sorted(allowed))}) {error}")
            wrong.append(ev.history(task_id))
    if wrong:
        _fail(ev, "never lost", "\n".join(wrong))


def check_one_attempt_at_a_time(ev: Evidence) -> None:
    """No two runs of one task overlap, except a run on a SIGSTOPped process whose row was taken
    from it once its lease lapsed; the late acknowledgement of that run must then be fenced: the
    row ends by a later attempt (check_done_comes_from_its_attempt proves which)."""
    by_task: dict[int, list[Run]] = defaultdict(list)
    for run in ev.runs:
        by_task[run.task_id].append(run)
    for task_id, runs in by_task.items():
        runs.sort(key=lambda r: r.start)
        for first, second in itertools.combinations(runs, 2):
            if second.start >= first.end:
                continue
            # The run on the frozen process, if one is: its row must have been taken from it, its
            # lease lapsed, before the two overlapped.
            frozen = first if first.pid in ev.stopped else second
            claim = ev.claim_of(frozen)
            lapsed = (
                frozen.pid in ev.stopped
                and claim is not None
                and claim.lapsed_before_out()
                and claim.out is not None
                and claim.out <= second.start
            )
            if not lapsed:
                _fail(
                    ev,
                    "never two attempts at once",
                    f"task {task_id}: {ev.describe(first)}\n overlaps {ev.describe(second)}\n"
                    + ev.history(task_id),
                )
            row = ev.rows.get(task_id)
            ev.notes.append(f"allowed overlap of task {task_id}: {ev.describe(frozen)}")
            if row is not None and row["attempts"] <= frozen.attempt and row["state"] in FINAL:
                _fail(
                    ev,
                    "a lapsed lease's late acknowledgement is fenced",
                    f"task {task_id} ended {row['state']} at attempt {row['attempts']}, the "
                    f"stopped run's: {ev.describe(frozen)}\n" + ev.history(task_id),
                )


def check_done_comes_from_its_attempt(ev: Evidence) -> None:
    """A row is marked done only from in_progress, by the attempt that owns it, once a run of
    that attempt by that owner has returned: no late acknowledgement of an older attempt, no
    acknowledgement of a run that did not finish. Every run matches a claim of its row."""
    for run in ev.runs:
        if ev.claim_of(run) is None:
            _fail(ev, "a handler runs only under its claim", ev.describe(run))
    for task_id, entries in ev.by_task.items():
        for e in entries:
            if e["op"] != "update" or e["new_state"] != "done" or e["old_state"] == "done":
                continue
            proof = [
                r
                for r in ev.runs
                if r.task_id == task_id
                and r.attempt == e["old_attempts"]
                and r.worker_id == e["old_worker"]
                and r.finished is not None
                and r.finished <= e["at"]
                and r.outcome == "ok"
            ]
            if e["old_state"] != "in_progress" or not proof:
                _fail(
                    ev,
                    "the end comes from the attempt that owns the row",
                    f"task {task_id} marked done at {_t(e['at'])} by attempt {e['old_attempts']}"
                    f" of worker {str(e['old_worker'])[:8]} from {e['old_state']}, with no"
                    " finished run of that attempt before it\n" + ev.history(task_id),
                )


_KEPT = ("attempts", "worker", "mark")


def check_finished_rows_stay_finished(ev: Evidence) -> None:
    """Once done, failed or cancelled, a row changes only by an operator's retry (back to
    queued) or delete: a worker's late acknowledgement never touches it. A workflow step's end is
    settled once (its edges told, the row marked as having no dependents left waiting, nothing
    else changed), and a join that its inputs' cancel cancelled waits again once they are
    retried."""
    retried = set(ev.bulk.get("retried", []))
    for task_id, entries in ev.by_task.items():
        for e in entries:
            if e["op"] == "update" and e["old_state"] in FINAL:
                if e["new_state"] == "queued" and task_id in retried:
                    continue
                same = all(e[f"old_{k}"] == e[f"new_{k}"] for k in _KEPT)
                if e.get("settled") and e["old_state"] == e["new_state"] and same:
                    continue
                resumed = ev.flow and task_id == ev.flow["join"] and retried
                if resumed and (e["old_state"], e["new_state"]) == ("cancelled", "waiting"):
                    continue
                _fail(
                    ev,
                    "a finished row stays finished",
                    f"task {task_id} changed from {e['old_state']} to {e['new_state']} at"
                    f" {_t(e['at'])}\n" + ev.history(task_id),
                )


def check_paused(ev: Evidence) -> None:
    """No claim of the paused queue whose statement began after the pause had committed and
    before the resume (a claim that began before it may still be finishing, and its handlers
    start after), hence no handler start in the pause of a task claimed during it."""
    for lo, hi in ev.pauses:
        for claims in ev.claims.values():
            for c in claims:
                if lo <= c.stmt <= hi:
                    _fail(
                        ev,
                        "paused means no start while paused",
                        f"task {c.task_id} claimed (attempt {c.attempt}) by a statement begun at"
                        f" {_t(c.stmt)}, inside the pause {_t(lo)} .. {_t(hi)}\n"
                        + ev.history(c.task_id),
                    )
        for run in ev.runs:
            claim = ev.claim_of(run)
            if lo <= run.start <= hi and (claim is None or claim.stmt >= lo):
                _fail(
                    ev,
                    "paused means no start while paused",
                    f"{ev.describe(run)} started inside the pause {_t(lo)} .. {_t(hi)}",
                )


def _max_overlap(spans: list[tuple[float, float, Run]]) -> tuple[int, float, list[Run]]:
    events = sorted(
        [(a, 1, r) for a, _, r in spans] + [(b, -1, r) for _, b, r in spans],
        key=lambda e: (e[0], e[1]),
    )
    live: list[Run] = []
    best, when, who = 0, 0.0, []
    for t, d, r in events:
        if d > 0:
            live.append(r)
        else:
            live.remove(r)
        if len(live) > best:
            best, when, who = len(live), t, list(live)
    return best, when, who


def check_limits(ev: Evidence) -> None:
    """At most the concurrency limit of runs at once by the database clock, and the key limit per
    key, each run counted while its lease holds (a lapsed lease frees its slot: the flow-control
    page); at most RATE + BURST - 1 handler starts, by the handlers' clock, in any one-second
    window."""
    spans = [(a, b, r) for r in ev.runs for a, b in ev.counted(r)]
    limit = ev.limits.get("concurrency")
    if limit is not None:
        best, when, who = _max_overlap(spans)
        if best > limit:
            _fail(
                ev,
                "limits never exceeded (concurrency)",
                f"{best} runs at {_t(when)}, limit {limit}:\n"
                + "\n".join(ev.describe(r) for r in who),
            )
    limit = ev.limits.get("key_concurrency")
    if limit is not None:
        for key in sorted(set(ev.enqueued.values())):
            mine = [s for s in spans if ev.enqueued.get(s[2].task_id) == key]
            best, when, who = _max_overlap(mine)
            if best > limit:
                _fail(
                    ev,
                    "limits never exceeded (per key)",
                    f"{best} runs of key {key!r} at {_t(when)}, limit {limit}:\n"
                    + "\n".join(ev.describe(r) for r in who),
                )
    rate = ev.limits.get("rate")
    if rate is not None:
        walls = sorted(ev.runs, key=lambda r: r.wall)
        j = 0
        for i, run in enumerate(walls):
            while walls[j].wall <= run.wall - 1.0:
                j += 1
            if i - j + 1 > rate + BURST - 1:
                window = walls[j : i + 1]
                _fail(
                    ev,
                    "limits never exceeded (rate)",
                    f"{len(window)} handler starts in the second before {_t(run.wall)}, limit"
                    f" {rate}/s (burst {BURST}):\n"
                    + "\n".join(f"{_t(r.wall)} {_paced(ev, r)} {ev.describe(r)}" for r in window),
                )


def _paced(ev: Evidence, run: Run) -> str:
    """How late a handler started after the moment its claim's pace gave it (started_at)."""
    claim = ev.claim_of(run)
    if claim is None or claim.moment is None:
        return "(no paced moment)"
    return f"(paced for {_t(claim.moment)}, started {1000 * (run.wall - claim.moment):+.0f} ms)"


def check_cancels(ev: Evidence) -> None:
    """A row with a cancel request never ends done, and never goes back to the queue (unless an
    operator retries it, which clears the request); a running task ends cancelled only by a
    request for it (a bulk cancel leaves running tasks alone); the cancelled target ended
    cancelled."""
    for task_id, entries in ev.by_task.items():
        for e in entries:
            if e["op"] != "update":
                continue
            if e["new_state"] == "done" and (e["old_mark"] or e["new_mark"]):
                _fail(ev, "cancelled never done", ev.history(task_id))
            if (
                e["old_mark"]
                and e["old_state"] == "in_progress"
                and e["new_state"] not in ("in_progress", "cancelled")
            ):
                _fail(
                    ev,
                    "a cancelled task is never put back in the queue",
                    f"task {task_id}: {e['old_state']} -> {e['new_state']} with its request"
                    "\n" + ev.history(task_id),
                )
            if (
                e["old_state"] == "in_progress"
                and e["new_state"] == "cancelled"
                and not e["old_mark"]
            ):
                _fail(
                    ev,
                    "only a request for it cancels a running task",
                    f"task {task_id} went from in_progress to cancelled with no request\n"
                    + ev.history(task_id),
                )


def check_bulk(ev: Evidence) -> None:
    """The bulk feature: the not-started tasks a bulk cancel named ended cancelled then (never
    run meanwhile), the running one it named was left alone, the retry brought each cancelled one
    back to run, the delete removed done rows only."""
    if not ev.bulk:
        return
    cancelled = set(ev.bulk["cancelled"])
    for task_id in ev.bulk["scheduled"]:
        if task_id not in cancelled:
            _fail(
                ev,
                "bulk cancel cancels what has not started",
                f"scheduled task {task_id} named by `worker cancel --ids` was not cancelled\n"
                f"{ev.bulk['cancel_output']}\n" + ev.history(task_id),
            )
    running = ev.bulk.get("running")
    if running is not None and running in cancelled:
        _fail(ev, "bulk cancel leaves running tasks alone", ev.history(running))
    if set(ev.bulk["retried"]) != cancelled:
        _fail(
            ev,
            "bulk retry requeues the cancelled tasks",
            f"cancelled {sorted(cancelled)}, requeued {sorted(ev.bulk['retried'])}\n"
            f"{ev.bulk['retry_output']}",
        )
    for task_id in ev.bulk["deleted"]:
        gone = [e for e in ev.by_task[task_id] if e["op"] == "delete"]
        if not gone or gone[0]["old_state"] != "done" or task_id in ev.rows:
            _fail(ev, "bulk delete deletes the done rows named", ev.history(task_id))
    for task_id, entries in ev.by_task.items():
        for e in entries:
            if e["op"] == "delete" and task_id not in ev.bulk["deleted"]:
                _fail(ev, "bulk delete deletes only the rows named", ev.history(task_id))


def check_results(ev: Evidence) -> None:
    """Every done row holds the value its own attempt returned; no other row holds one."""
    if "results" not in ev.options:
        return
    for task_id, row in ev.rows.items():
        if task_id == ev.bad_typed:
            continue
        expected = None
        if row["state"] == "done":
            expected = {
                "task_id": task_id,
                "attempt": row["attempts"],
                "worker_id": row["worker_id"],
            }
        if row["result"] != expected:
            _fail(
                ev,
                "a done task holds its own attempt's result",
                f"task {task_id} ({row['state']}, attempt {row['attempts']}, worker"
                f" {row['worker_id']}) holds {row['result']!r}\n" + ev.history(task_id),
            )


def check_transactional(ev: Evidence) -> None:
    """A transactional handler's side effect is committed exactly once for a done task, by the
    attempt that completed it, and never for a task that did not end done."""
    if "tx" not in ev.options:
        return
    effects: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for task_id, attempt, worker_id in ev.effects:
        effects[task_id].append((attempt, worker_id))
    for task_id in ev.enqueued:
        row = ev.rows.get(task_id)
        if row is None:  # deleted once done: its end is in the log
            last = [e for e in ev.by_task[task_id] if e["op"] == "delete"][-1]
            row = {"state": last["old_state"], "attempts": last["old_attempts"]}
            row["worker_id"] = last["old_worker"]
        want = [(row["attempts"], row["worker_id"])] if row["state"] == "done" else []
        if task_id == ev.bad_typed:
            want = []
        if sorted(effects.get(task_id, [])) != want:
            _fail(
                ev,
                "a transactional handler's writes commit with its task, once",
                f"task {task_id} ended {row['state']} (attempt {row['attempts']}); side effects"
                f" {effects.get(task_id, [])}\n" + ev.history(task_id),
            )


def check_typed(ev: Evidence) -> None:
    """Handlers of typed tasks receive the dataclass; the row that does not fit it fails at once,
    never run, never retried."""
    if "typed" not in ev.options:
        return
    for run in ev.runs:
        if run.typed != "MxPayload":
            _fail(ev, "a typed handler receives its model", f"{ev.describe(run)}: {run.typed}")
    assert ev.bad_typed is not None
    row = ev.rows[ev.bad_typed]
    ran = [r for r in ev.runs if r.task_id == ev.bad_typed]
    if row["state"] != "failed" or row["attempts"] != 1 or ran:
        _fail(
            ev,
            "a payload that does not fit fails at once",
            f"task {ev.bad_typed}: {row['state']}, attempts {row['attempts']},"
            f" {row['last_error']!r}, {len(ran)} runs",
        )
    if not str(row["last_error"]).startswith("PayloadError: "):
        _fail(ev, "a payload that does not fit fails at once", str(row["last_error"]))


def _done_by(ev: Evidence, task_id: int) -> dict[str, Any] | None:
    """The log entry that marked a task done (its row may have been deleted since)."""
    done = [
        e for e in ev.by_task.get(task_id, []) if e["op"] == "update" and e["new_state"] == "done"
    ]
    return done[-1] if done else None


def check_workflow(ev: Evidence) -> None:
    """The workflow feature: the join is released (waiting to queued) once, after every input
    ended done; none of its runs starts before that; the run that completed it read its inputs'
    results in the order the group named them, each the value of the attempt that completed that
    input. A join whose input was cancelled ends cancelled, its error naming the dependency, and
    never runs."""
    if not ev.flow:
        return
    join, inputs = ev.flow["join"], ev.flow["inputs"]
    row = ev.rows[join]
    released = [
        e
        for e in ev.by_task[join]
        if e["op"] == "update" and (e["old_state"], e["new_state"]) == ("waiting", "queued")
    ]
    runs = [r for r in ev.runs if r.task_id == join]
    if row["state"] == "cancelled" and ev.cancel.get("target") == join:
        return  # the case cancelled the join itself while it ran: check_cancels' business
    if row["state"] == "cancelled":
        if runs or released or not str(row["last_error"]).startswith("DependencyFailed: "):
            _fail(
                ev,
                "a cancelled input cancels the join",
                f"join {join}: {len(runs)} runs, released {len(released)} times, error"
                f" {row['last_error']!r}\n" + ev.history(join),
            )
        return
    if len(released) != 1:
        _fail(ev, "a join is released once", ev.history(join))
    dones = {t: _done_by(ev, t) for t in inputs}
    rel = released[0]
    # By the clock of the trigger that logged each change, except within one statement: the
    # acknowledgement that settles the join does both, and the trigger logs the steps it
    # acknowledged when that statement ends, after the join's change made inside it.
    early = [
        t
        for t, e in dones.items()
        if e is None or (e["stmt"] != rel["stmt"] and e["at"] > rel["at"])
    ]
    if early:
        _fail(
            ev,
            "a join is released once its inputs are all done",
            f"join {join} released at {_t(rel['at'])}; inputs not done by then {early}\n"
            + "\n".join(ev.history(t) for t in early[:3]),
        )
    for run in runs:
        if run.start < released[0]["at"]:
            _fail(ev, "a join runs after its inputs", ev.describe(run) + "\n" + ev.history(join))
    expected = [
        {"task_id": t, "attempt": e["old_attempts"], "worker_id": e["old_worker"]}
        for t, e in dones.items()
        if e is not None
    ]
    final = [r for r in runs if r.outcome == "ok" and r.attempt == row["attempts"]]
    if row["state"] != "done" or not final or final[-1].inputs != expected:
        got = final[-1].inputs if final else None
        _fail(
            ev,
            "a join reads its inputs' results in order",
            f"join {join} ended {row['state']}; its run read {got!r}, expected {expected!r}\n"
            + ev.history(join),
        )


def check_where_it_ran(ev: Evidence) -> None:
    """Every run was on a process of the case's fleets, of the kind the features ask for."""
    for run in ev.runs:
        if run.kind != ev.kind or run.pid not in ev.fleet_pids:
            _fail(
                ev,
                "the tasks run where the features put them",
                f"{ev.describe(run)}: kind {run.kind}, expected {ev.kind}"
                f" on {sorted(ev.fleet_pids)}",
            )


CHECKS: list[Callable[[Evidence], None]] = [
    check_never_lost,
    check_one_attempt_at_a_time,
    check_done_comes_from_its_attempt,
    check_finished_rows_stay_finished,
    check_paused,
    check_limits,
    check_cancels,
    check_bulk,
    check_results,
    check_transactional,
    check_typed,
    check_workflow,
    check_where_it_ran,
]


def check_promises(ev: Evidence) -> None:
    for check in CHECKS:
        check(ev)


# -- running a case -------------------------------------------------------------------------------


class Db:
    """The test's own connection, made again after a server restart."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection | None = None

    def __call__(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.conn is None or self.conn.closed or self.conn.broken:
                    self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
                cur = self.conn.execute(sql, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                self.conn = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def now(self) -> float:
        return self("SELECT clock_timestamp()")[0][0].timestamp()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Fleet:
    """The processes that run a case's tasks: `worker run` with a supervisor and PROCESSES
    children, or PROCESSES `manage.py worker_run` processes, or PROCESSES application processes
    with a BackgroundWorker."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> Fleet:
        h = self.h
        lease = f"{h.lease:g}"
        common = ["--concurrency", str(SLOTS), "--lease", lease, "--grace", "5"]
        common += ["--poll-interval", "0.2"]
        if h.kind == "cli":
            argv = [sys.executable, "-m", "worker", "run", "matrix_module", "--queues", "mx"]
            argv += ["--dsn", h.dsn, "--schema", h.schema, "--processes", str(PROCESSES)]
            argv += ["--log-level", "WARNING", *common]
            self._spawn(argv)
        elif h.kind == "django":
            argv = [sys.executable, "-m", "django", "worker_run", "--backend", "matrix"]
            argv += ["--queues", "mx", *common]
            for _ in range(PROCESSES):
                self._spawn(argv)
        else:
            argv = [sys.executable, str(ROOT / "tests" / "matrix_app.py"), "serve"]
            if h.case.has("django"):
                argv.append("--django")
            for _ in range(PROCESSES):
                self._spawn(argv)
        return self

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.h.tmp / f"fleet-{len(self.h.fleets)}-{len(self.procs)}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, env=self.h.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        log.close()
        self.procs.append(proc)
        self.h.fleet_pids.add(proc.pid)

    def workers(self) -> set[int]:
        """The processes that run handlers (a supervisor's children, or the processes)."""
        if self.h.kind != "cli":
            return {p.pid for p in self.procs if p.poll() is None}
        pids = set()
        with contextlib.suppress(psutil.NoSuchProcess):
            for kid in psutil.Process(self.procs[0].pid).children():
                if _alive(kid.pid):
                    pids.add(kid.pid)
        self.h.fleet_pids |= pids
        return pids

    def everything(self) -> set[int]:
        pids = {p.pid for p in self.procs if p.poll() is None}
        for p in list(pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                pids |= {k.pid for k in psutil.Process(p).children(recursive=True)}
        self.h.fleet_pids |= pids
        return pids

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def wait_gone(self, pids: set[int], timeout: float) -> None:
        """Wait until every one of ``pids`` is gone, noting when each was seen gone."""
        deadline = time.monotonic() + timeout
        left = set(pids)
        while left:
            for p in self.procs:
                p.poll()
            for pid in list(left):
                if not _alive(pid):
                    self.h.deaths[pid] = time.time()
                    left.discard(pid)
            if left and time.monotonic() > deadline:
                raise AssertionError(f"processes {sorted(left)} still alive after {timeout}s")
            time.sleep(0.01)

    def stop(self, timeout: float = 20.0) -> None:
        pids = self.everything()
        self.signal_all(signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            self.wait_gone(pids, timeout)
        self.kill()

    def kill(self) -> None:
        pids = self.everything()
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for pid in pids:
            if pid not in self.h.deaths:
                self.h.deaths[pid] = time.time()


class Harness:
    """One case: its schema, its fleets, what it did and when."""

    def __init__(self, case: Case, server: EmbeddedPostgres, tmp: Path, seed: int) -> None:
        self.case, self.server, self.tmp, self.seed = case, server, tmp, seed
        self.dsn = server.start()  # running already: its DSN
        self.schema = f"mx_{uuid.uuid4().hex[:10]}"
        self.rng = random.Random(f"{seed}:{case.name}")
        self.db = Db(self.dsn)
        self.kind = "inproc" if case.has("inproc") else "django" if case.has("django") else "cli"
        self.lease = LEASE_DB_RESTART if case.fault == "db-restart" else LEASE
        self.options = {
            o
            for f, o in (("results", "results"), ("transactional", "tx"), ("typed", "typed"))
            if case.has(f)
        }
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "tests"),
            "WORKER_DSN": self.dsn,
            "WORKER_SCHEMA": self.schema,
            "MATRIX_KIND": self.kind,
            "MATRIX_LEASE": str(self.lease),
            "MATRIX_CONCURRENCY": str(SLOTS),
            "DJANGO_SITE_DSN": self.dsn,
            "DJANGO_SITE_SCHEMA": self.schema,
            "DJANGO_SETTINGS_MODULE": "django_site.settings",
        }
        self.fleets: list[Fleet] = []
        self.fleet_pids: set[int] = set()
        self.deaths: dict[int, float] = {}
        self.stopped: dict[int, tuple[float, float]] = {}
        self.pauses: list[tuple[float, float]] = []
        self.limits: dict[str, int] = {}
        self.enqueued: dict[int, str] = {}
        self.cancel: dict[str, Any] = {}
        self.bulk: dict[str, Any] = {}
        self.bad_typed: int | None = None
        self.flow: dict[str, Any] = {}
        self.faulted_at = float("inf")
        self.held: psycopg.Connection | None = None
        self.notes: list[str] = []
        self.cancel_proc: subprocess.Popen[str] | None = None

    # -- helpers

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`worker ARGS --dsn --schema`, again while the server is away (a restart)."""
        deadline = time.monotonic() + 30
        while True:
            out = run_cli(*args, "--dsn", self.dsn, "--schema", self.schema, env=self.env)
            if out.returncode != 2 or time.monotonic() > deadline:
                return out
            time.sleep(0.2)  # unreachable database: the restart is not over

    def states(self) -> dict[str, int]:
        return dict(self.db(f"SELECT state::text, count(*) FROM {self.schema}.tasks GROUP BY 1"))

    def running_runs(self) -> list[tuple[int, int]]:
        """(task id, pid) of runs going on now whose rows are in progress."""
        return [
            (t, p)
            for t, p in self.db(
                f"SELECT r.task_id, r.pid FROM {self.schema}.mx_runs r JOIN {self.schema}.tasks t"
                " ON t.id = r.task_id AND t.state = 'in_progress' AND t.attempts = r.attempt"
                " WHERE r.finished IS NULL ORDER BY r.id"
            )
        ]

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.case.name}: {what} not within {timeout}s; states {self.states()}"
                )
            time.sleep(0.05)

    # -- the steps

    def prepare(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            migrate(c, self.schema)
            c.execute(INSTRUMENTS.format(s=self.schema))
        _T0[0] = self.db.now()
        limits: list[str] = []
        if self.case.has("concurrency"):
            limits += ["--concurrency", str(CONCURRENCY)]
            self.limits["concurrency"] = CONCURRENCY
        if self.case.has("key-limit"):
            limits += ["--key-concurrency", str(KEY_CONCURRENCY)]
            self.limits["key_concurrency"] = KEY_CONCURRENCY
        if self.case.has("rate"):
            limits += ["--rate", f"{RATE}/s"]
            self.limits["rate"] = RATE
        if limits:
            out = self.cli("limits", "set", "mx", *limits)
            assert out.returncode == 0, out.stderr

    def enqueue(self) -> None:
        keyed = self.case.has("key-limit")
        if self.case.has("django"):
            out = subprocess.run(
                [
                    *(sys.executable, str(ROOT / "tests" / "matrix_app.py"), "enqueue-django"),
                    *(str(SLEEP), str(N_TASKS), "3" if self.case.has("bulk") else "0"),
                    *(str(LONG), str(LONG_SLEEP)),
                ],
                env=self.env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            ids = [int(line) for line in out.stdout.split()]
            self.enqueued = dict.fromkeys(ids, "")
            if self.case.has("bulk"):
                self.bulk["scheduled"] = ids[N_TASKS:]  # three not due before the bulk cancel
            assert len(ids) == N_TASKS + (3 if self.case.has("bulk") else 0)
        name = task_name(self.options)
        typed = "typed" in self.options

        def payload(i: int) -> Any:
            key, sleep = f"k{i % KEYS}", LONG_SLEEP if i < LONG else SLEEP
            return MxPayload(sleep, key, i) if typed else {"sleep": sleep, "key": key, "n": i}

        with psycopg.connect(self.dsn, autocommit=True) as c:
            if self.case.has("workflow"):
                steps = [
                    worker.step(name, payload(i), limit_key=f"k{i % KEYS}" if keyed else None)
                    for i in range(N_TASKS)
                ]
                flow = worker.group(steps[:-1], then=steps[-1], name="mx")
                ids = worker.enqueue_workflow(c, flow, schema=self.schema)
                self.enqueued = {ids[s]: s.limit_key or "" for s in steps}
                self.flow = {"inputs": [ids[s] for s in steps[:-1]], "join": ids[steps[-1]]}
            elif not self.case.has("django"):
                for i in range(N_TASKS):
                    key = f"k{i % KEYS}" if keyed else None
                    task_id = worker.enqueue(c, name, payload(i), limit_key=key, schema=self.schema)
                    self.enqueued[task_id] = key or ""
            if self.case.has("bulk") and not self.case.has("django"):
                self.bulk["scheduled"] = []  # three not due before the bulk cancel
                for i in range(3):
                    key = f"k{i % KEYS}" if keyed else None
                    task_id = worker.enqueue(
                        c, name, payload(100 + i), delay=600, limit_key=key, schema=self.schema
                    )
                    self.enqueued[task_id] = key or ""
                    self.bulk["scheduled"].append(task_id)
            if typed:  # a row written by SQL that does not fit MxPayload
                (row,) = c.execute(
                    f"INSERT INTO {self.schema}.tasks (task, queue, payload, limit_key)"
                    " VALUES (%s, 'mx', '{\"sleep\": \"long\"}', %s) RETURNING id",
                    (name, "k0" if keyed else None),
                ).fetchall()
                self.bad_typed = row[0]
                self.enqueued[row[0]] = "k0" if keyed else ""

    def start_fleet(self) -> Fleet:
        fleet = Fleet(self).start()
        self.fleets.append(fleet)
        return fleet

    @property
    def fleet(self) -> Fleet:
        return self.fleets[-1]

    def phase_a(self) -> None:
        """While tasks run: pause the queue, bulk-cancel some tasks."""
        self.wait("two runs started", lambda: len(self.running_runs()) >= 2, 60)
        if self.case.has("pause"):
            out = self.cli("pause", "mx")
            assert out.returncode == 0, out.stderr
            self.pause_from = self.db.now()  # the pause has committed by now
        if self.case.has("bulk"):
            running = [t for t, _ in self.running_runs()]
            queued = [
                t
                for (t,) in self.db(
                    f"SELECT id FROM {self.schema}.tasks WHERE state = 'queued' ORDER BY id DESC"
                    " LIMIT 2"
                )
            ]
            self.bulk["running"] = running[-1] if running else None
            ids = self.bulk["scheduled"] + queued + running[-1:]
            out = self.cli("cancel", "--ids", ",".join(map(str, ids)), "--yes")
            assert out.returncode == 0, out.stdout + out.stderr
            self.bulk["cancel_output"] = out.stdout
            self.bulk["cancelled"] = [
                t
                for (t,) in self.db(
                    f"SELECT DISTINCT task_id FROM {self.schema}.mx_log WHERE op = 'update'"
                    " AND new_state = 'cancelled' AND old_state IN ('queued', 'scheduled')"
                    " AND task_id = ANY(%s)",
                    (ids,),
                )
            ]

    def start_cancel(self) -> None:
        """The cancel feature: `worker cancel ID` of a running task, started just before the
        fault, so that its request lands as the fault strikes."""
        if not self.case.has("cancel"):
            return
        busy = self.wait(
            "a running task to cancel",
            lambda: [t for t, _ in self.running_runs() if t != self.bulk.get("running")],
            30,
        )
        self.cancel["target"] = target = self.rng.choice(busy)
        self.cancel_proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "worker", "cancel", str(target), "--json"),
                *("--dsn", self.dsn, "--schema", self.schema),
            ],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish_cancel(self) -> None:
        if self.cancel_proc is None:
            return
        out, err = self.cancel_proc.communicate(timeout=60)
        if self.cancel_proc.returncode == 2:  # the server was away: ask again
            again = self.cli("cancel", str(self.cancel["target"]), "--json")
            out, err = again.stdout, again.stderr
        self.cancel["output"] = out + err
        self.cancel["outcome"] = json.loads(out)["outcome"]

    def target(self) -> int:
        """A worker process that is running a task now (drawn by the case's seed)."""
        workers = self.fleet.workers()
        busy = sorted({p for _, p in self.running_runs() if p in workers})
        return self.rng.choice(busy or sorted(workers))

    def fault(self) -> None:
        fault = self.case.fault
        fleet = self.fleet
        with contextlib.suppress(AssertionError):  # in a paused queue, maybe none
            self.wait("a worker process running a task", lambda: self.running_runs(), 10)
        self.start_cancel()
        self.faulted_at = time.time()
        if fault == "sigterm":
            pids = fleet.everything()
            fleet.signal_all(signal.SIGTERM)
            fleet.wait_gone(pids, 30)
            self.start_fleet()
        elif fault == "kill-child":
            pid = self.target()
            os.kill(pid, signal.SIGKILL)
            fleet.wait_gone({pid}, 10)
        elif fault == "kill-supervisor":
            pids = fleet.everything()
            os.kill(fleet.procs[0].pid, signal.SIGKILL)
            fleet.wait_gone(pids, 10)
            self.start_fleet()
        elif fault == "sigstop":
            pid = self.target()
            os.kill(pid, signal.SIGSTOP)
            frozen = time.time()
            time.sleep(2 * self.lease)
            os.kill(pid, signal.SIGCONT)
            self.stopped[pid] = (frozen, time.time())
        elif fault == "db-restart":
            self.db.close()
            began = time.monotonic()
            self.server.stop()
            self.server.start()
            outage = time.monotonic() - began
            self.notes.append(f"the server was down {outage:.2f}s")
            assert outage < self.lease / 2, f"outage {outage:.1f}s: too long for lease {self.lease}"
        elif fault == "held-xact":
            self.held = psycopg.connect(self.dsn)
            self.held.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            self.held.execute(f"SELECT count(*) FROM {self.schema}.tasks").fetchall()
            self.held.execute("SELECT txid_current()").fetchall()
            pid = self.held.info.backend_pid
            held = self.db(
                "SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            assert held == [(True,)], held
        else:  # pragma: no cover
            raise AssertionError(fault)

    def phase_b(self) -> None:
        """After the fault: the cancel's answer, the resume, the bulk retry."""
        self.finish_cancel()
        if self.case.has("pause"):
            time.sleep(1.0)  # the pause holds over the recovery too
            until = self.db.now()  # before the resume commits
            out = self.cli("resume", "mx")
            assert out.returncode == 0, out.stderr
            self.pauses.append((self.pause_from, until))
        if self.case.has("bulk"):
            ids = self.bulk["cancelled"]
            out = self.cli(
                "retry", "--ids", ",".join(map(str, ids)), "--state", "cancelled", "--yes"
            )
            assert out.returncode == 0, out.stdout + out.stderr
            self.bulk["retry_output"] = out.stdout
            self.bulk["retried"] = [
                t
                for (t,) in self.db(
                    f"SELECT DISTINCT task_id FROM {self.schema}.mx_log WHERE op = 'update'"
                    " AND old_state = 'cancelled' AND new_state = 'queued'"
                )
            ]

    def settled(self) -> bool:
        left = self.db(
            f"SELECT count(*) FROM {self.schema}.tasks"
            " WHERE state IN ('queued', 'scheduled', 'in_progress', 'waiting')"
        )[0][0]
        if left:
            return False
        open_runs = [
            p
            for (p,) in self.db(f"SELECT pid FROM {self.schema}.mx_runs WHERE finished IS NULL")
            if _alive(p)
        ]
        return not open_runs

    def settle(self) -> None:
        self.wait("every task settled (never lost)", self.settled, SETTLE_TIMEOUT)

    def phase_c(self) -> None:
        if self.case.has("bulk"):
            done = [
                t
                for (t,) in self.db(
                    f"SELECT id FROM {self.schema}.tasks WHERE state = 'done' AND id = ANY(%s)"
                    " ORDER BY id LIMIT 2",
                    (self.bulk["retried"],),
                )
            ]
            out = self.cli("delete", "--ids", ",".join(map(str, done)), "--state", "done", "--yes")
            assert out.returncode == 0, out.stdout + out.stderr
            self.bulk["deleted"] = done

    def release(self) -> None:
        if self.held is not None:
            self.held.close()
            self.held = None

    def cleanup(self) -> None:
        if self.cancel_proc is not None and self.cancel_proc.poll() is None:
            self.cancel_proc.kill()
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for fleet in self.fleets:
            fleet.kill()
        self.release()
        with contextlib.suppress(psycopg.Error):
            self.db(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
        self.db.close()

    def evidence(self) -> Evidence:
        s = self.schema
        runs = [
            Run(
                id=r[0],
                task_id=r[1],
                attempt=r[2],
                worker_id=str(r[3]),
                pid=r[4],
                kind=r[5],
                typed=r[6],
                wall=r[7],
                start=_ts(r[8]) or 0.0,
                finished=_ts(r[9]),
                outcome=r[10],
                late=bool(r[11] or r[12]),
                inputs=r[13],
            )
            for r in self.db(
                "SELECT id, task_id, attempt, worker_id, pid, kind, typed, wall, started,"
                f" finished, outcome, late_start, late_end, inputs FROM {s}.mx_runs ORDER BY id"
            )
        ]
        cols = [
            "id", "op", "task_id", "old_state", "new_state", "old_attempts", "new_attempts",
            "old_worker", "new_worker", "lease", "old_mark", "new_mark", "at", "stmt", "app",
            "moment", "settled",
        ]  # fmt: skip
        log = []
        for r in self.db(f"SELECT {', '.join(cols)} FROM {s}.mx_log ORDER BY id"):
            e = dict(zip(cols, r, strict=True))
            for k in ("lease", "at", "stmt", "moment"):
                e[k] = _ts(e[k])
            for k in ("old_worker", "new_worker"):
                e[k] = None if e[k] is None else str(e[k])
            log.append(e)
        rows = {
            r[0]: {
                "state": r[1],
                "attempts": r[2],
                "worker_id": None if r[3] is None else str(r[3]),
                "result": r[4],
                "last_error": r[5],
            }
            for r in self.db(
                f"SELECT id, state::text, attempts, worker_id, result, last_error FROM {s}.tasks"
            )
        }
        effects = [
            (t, a, str(w)) for t, a, w in self.db(f"SELECT * FROM {s}.mx_effects ORDER BY 1")
        ]
        return Evidence(
            case=self.case,
            seed=self.seed,
            enqueued=self.enqueued,
            # Django's tasks always store their results.
            options=self.options | ({"results"} if self.case.has("django") else set()),
            runs=runs,
            log=log,
            rows=rows,
            effects=effects,
            deaths=self.deaths,
            faulted_at=self.faulted_at,
            stopped=self.stopped,
            pauses=self.pauses,
            limits=self.limits,
            cancel=self.cancel,
            bulk=self.bulk,
            bad_typed=self.bad_typed,
            kind=self.kind,
            fleet_pids=self.fleet_pids,
            notes=self.notes,
            flow=self.flow,
        )


def run_case(case: Case, server: EmbeddedPostgres, tmp: Path, seed: int) -> Evidence:
    h = Harness(case, server, tmp, seed)
    try:
        h.prepare()
        h.enqueue()
        h.start_fleet()
        h.phase_a()
        h.fault()
        h.phase_b()
        h.settle()
        h.phase_c()
        for fleet in h.fleets:
            fleet.workers()  # note the children's pids before they go
            fleet.stop()
        h.release()
        ev = h.evidence()
    except Exception as exc:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("fleet-*.log"))
        )
        raise AssertionError(
            f"{case.name} (seed {seed}) did not run to its end: {exc}\n{logs}"
        ) from exc
    finally:
        h.cleanup()
    print(summary(ev))
    check_promises(ev)
    for note in ev.notes[1 if case.fault == "db-restart" else 0 :]:
        print(f"  {note}")
    return ev


def summary(ev: Evidence) -> str:
    """One paragraph on what the case did, printed with each case (pytest shows it on failure,
    and with -s)."""
    spans = [(a, b, r) for r in ev.runs for a, b in ev.counted(r)]
    ends: dict[str, int] = defaultdict(int)
    for row in ev.rows.values():
        ends[row["state"]] += 1
    return (
        f"{ev.case.name}: {len(ev.enqueued)} tasks, {len(ev.runs)} runs"
        f" ({sum(1 for r in ev.runs if r.finished is None)} cut short),"
        f" {sum(len(c) for c in ev.claims.values())} claims, ends {dict(ends)},"
        f" most at once {_max_overlap(spans)[0]}, deaths {len(ev.deaths)},"
        f" stopped {sorted(ev.stopped)}, pauses {[(_t(a), _t(b)) for a, b in ev.pauses]},"
        f" cancel {ev.cancel.get('target')}:{ev.cancel.get('outcome')},"
        f" bulk { ({k: v for k, v in ev.bulk.items() if not k.endswith('output')}) }; "
        + "; ".join(ev.notes)
    )


@pytest.mark.slow
@pytest.mark.db  # a server of its own (matrix_server), not the session's pg_dsn
@pytest.mark.parametrize("case", CASES, ids=[f"seed{SEED}-{c.name}" for c in CASES])
def test_matrix(case: Case, matrix_server: EmbeddedPostgres, tmp_path: Path) -> None:
    print(f"composition matrix: seed {SEED}, case {case.name}")
    run_case(case, matrix_server, tmp_path, SEED)


def test_the_table_is_whole() -> None:
    """Every pair under every fault is a case or excluded with a reason; a case named by
    WORKER_MATRIX_CASES parses, in either order of its pair; the sample has one case per fault."""
    pairs = list(itertools.combinations(FEATURES, 2))
    assert len(pairs) == 66
    cases = {c.name for c in all_cases()}
    for pair in pairs:
        for fault in FAULTS:
            name = f"{'+'.join(pair)}:{fault}"
            assert (name in cases) != (excluded(pair, fault) is not None), name
    assert parse_case("rate+pause:sigstop") == Case(("pause", "rate"), "sigstop")
    with pytest.raises(ValueError, match=r"is excluded: `manage\.py worker_run` is one process"):
        parse_case("django+results:kill-supervisor")
    with pytest.raises(ValueError, match=r"FEATURE\+FEATURE:FAULT"):
        parse_case("pause+pause:sigterm")
    sample = [c.fault for c in random_sample(SEED)]
    assert sorted(sample) == sorted(FAULTS)
    assert random_sample(SEED) == random_sample(SEED)


# -- the checks themselves, on made-up evidence -------------------------------------------------

W1, W2 = "11111111-0000-0000-0000-000000000000", "22222222-0000-0000-0000-000000000000"


def _entry(task_id: int, at: float, old: str | None, new: str | None, **kw: Any) -> dict[str, Any]:
    entry = {
        "op": "update" if old and new else "insert" if new else "delete",
        "task_id": task_id,
        "old_state": old,
        "new_state": new,
        "old_attempts": kw.get("attempt", 1),
        "new_attempts": kw.get("attempt", 1),
        "old_worker": kw.get("worker", W1),
        "new_worker": kw.get("worker", W1),
        "lease": kw.get("lease"),
        "old_mark": kw.get("mark", False),
        "new_mark": kw.get("mark", False),
        "at": at,
        "stmt": kw.get("stmt", at),
        "app": "",
    }
    return entry


def _attempt(task_id: int, claim: float, end: float, lease: float = 3.0, **kw: Any) -> list:
    """The log of one claimed attempt that ends done at ``end`` (heartbeats every second)."""
    log = [_entry(task_id, claim, "queued", "in_progress", lease=claim + lease, **kw)]
    t = claim + 1
    while t < end:
        log.append(_entry(task_id, t, "in_progress", "in_progress", lease=t + lease, **kw))
        t += 1
    log.append(_entry(task_id, end, "in_progress", kw.pop("to", "done"), **kw))
    return log


def _run(n: int, task_id: int, start: float, end: float | None, **kw: Any) -> Run:
    return Run(
        id=n,
        task_id=task_id,
        attempt=kw.get("attempt", 1),
        worker_id=kw.get("worker", W1),
        pid=kw.get("pid", 100),
        kind="cli",
        typed="",
        wall=start,
        start=start,
        finished=end,
        outcome="ok" if end is not None else None,
        late=False,
    )


def _made_up(runs: list[Run], log: list[dict[str, Any]], **kw: Any) -> Evidence:
    tasks = sorted({r.task_id for r in runs} | {e["task_id"] for e in log})
    rows = kw.pop("rows", None) or {
        t: {"state": "done", "attempts": 1, "worker_id": W1, "result": None, "last_error": None}
        for t in tasks
    }
    fields: dict[str, Any] = {
        "case": Case(("pause", "rate"), "sigstop"),
        "seed": 0,
        "enqueued": dict.fromkeys(tasks, ""),
        "options": set(),
        "runs": runs,
        "log": [{"id": i, **e} for i, e in enumerate(log)],
        "rows": rows,
        "effects": [],
        "deaths": {},
        "faulted_at": 0.0,
        "stopped": {},
        "pauses": [],
        "limits": {},
        "cancel": {},
        "bulk": {},
        "bad_typed": None,
        "kind": "cli",
        "fleet_pids": {100, 200},
        "notes": [],
    }
    fields.update(kw)
    return Evidence(**fields)


def test_the_checks_catch_two_attempts_at_once() -> None:
    """A second attempt that starts while the first still runs breaks the promise, unless the
    first is on a SIGSTOPped process whose lease lapsed and whose row was taken before; even
    then the row must not end by the stopped attempt."""
    log = _attempt(1, 10.0, 11.0) + _attempt(1, 11.5, 14.0, attempt=2, worker=W2)
    first = _run(1, 1, 10.1, 15.0)  # still running when attempt 2 starts
    second = _run(2, 1, 11.6, 13.9, attempt=2, worker=W2, pid=200)
    rows = {
        1: {"state": "done", "attempts": 2, "worker_id": W2, "result": None, "last_error": None}
    }
    with pytest.raises(Broken, match="never two attempts at once"):
        check_one_attempt_at_a_time(_made_up([first, second], log, rows=rows))
    # Frozen: attempt 1 was rescued (lease lapsed at 13.0, taken at 13.2), then claimed again.
    frozen = [
        _entry(1, 10.0, "queued", "in_progress", lease=13.0),
        _entry(1, 13.2, "in_progress", "queued"),
        *_attempt(1, 13.4, 16.0, attempt=2, worker=W2),
    ]
    late = _run(1, 1, 10.1, 17.0, pid=100)
    second = _run(2, 1, 13.5, 15.9, attempt=2, worker=W2, pid=200)
    ev = _made_up([late, second], frozen, rows=rows, stopped={100: (10.5, 16.5)})
    check_one_attempt_at_a_time(ev)
    check_done_comes_from_its_attempt(ev)
    ended_by_the_stopped = {1: {**rows[1], "attempts": 1}}
    with pytest.raises(Broken, match="late acknowledgement is fenced"):
        check_one_attempt_at_a_time(
            _made_up([late, second], frozen, rows=ended_by_the_stopped, stopped={100: (10, 16)})
        )


def test_the_checks_catch_a_done_without_its_run() -> None:
    """Done by an attempt none of whose runs had finished, or by a stale attempt: broken."""
    log = _attempt(1, 10.0, 11.0)
    with pytest.raises(Broken, match="the end comes from the attempt that owns the row"):
        check_done_comes_from_its_attempt(_made_up([_run(1, 1, 10.1, 11.5)], log))
    check_done_comes_from_its_attempt(_made_up([_run(1, 1, 10.1, 10.9)], log))
    with pytest.raises(Broken, match="a handler runs only under its claim"):
        check_done_comes_from_its_attempt(_made_up([_run(1, 1, 9.0, 9.5)], log))


def test_the_checks_catch_limits_exceeded() -> None:
    """Three runs at once over a limit of 2 break it, unless one of them had lost its lease
    (its slot freed, as the flow-control page says); six starts in a second over 5/s break it."""
    log = _attempt(1, 10.0, 13.0) + _attempt(2, 10.0, 13.0) + _attempt(3, 11.0, 13.0)
    runs = [_run(1, 1, 10.1, 12.9), _run(2, 2, 10.1, 12.9), _run(3, 3, 11.1, 12.9)]
    with pytest.raises(Broken, match=r"limits never exceeded \(concurrency\)"):
        check_limits(_made_up(runs, log, limits={"concurrency": 2}))
    # Task 1's lease lapsed at 11.0 (no heartbeat), its row rescued at 11.5.
    lapsed = [
        _entry(1, 10.0, "queued", "in_progress", lease=11.0),
        _entry(1, 11.5, "in_progress", "queued"),
    ]
    ev = _made_up(runs, lapsed + log[5:], limits={"concurrency": 2}, stopped={100: (10.5, 12)})
    check_limits(ev)
    keyed = _made_up(runs, log, limits={"key_concurrency": 1})
    keyed.enqueued = {1: "a", 2: "b", 3: "a"}
    with pytest.raises(Broken, match=r"limits never exceeded \(per key\)"):
        check_limits(keyed)
    starts = [_run(i, i, 20.0 + i * 0.15, 20.1 + i * 0.15) for i in range(1, 7)]
    with pytest.raises(Broken, match=r"limits never exceeded \(rate\)"):
        check_limits(_made_up(starts, [], limits={"rate": 5}))
    check_limits(_made_up(starts[:5], [], limits={"rate": 5}))


def test_the_checks_catch_a_start_while_paused_and_a_cancelled_task_done() -> None:
    log = _attempt(1, 12.0, 13.0, stmt=11.9)
    with pytest.raises(Broken, match="paused means no start while paused"):
        check_paused(_made_up([_run(1, 1, 12.1, 12.9)], log, pauses=[(11.0, 14.0)]))
    check_paused(_made_up([_run(1, 1, 12.1, 12.9)], log, pauses=[(12.5, 14.0)]))
    marked = _attempt(1, 10.0, 11.0, mark=True)
    with pytest.raises(Broken, match="cancelled never done"):
        check_cancels(_made_up([_run(1, 1, 10.1, 10.9)], marked))
    requeued = _attempt(1, 10.0, 11.0, mark=True, to="queued")
    with pytest.raises(Broken, match="never put back in the queue"):
        check_cancels(_made_up([_run(1, 1, 10.1, 10.9)], requeued))
    left = {1: {"state": "queued", "attempts": 0, "worker_id": None, "result": None}}
    with pytest.raises(Broken, match="never lost"):
        check_never_lost(_made_up([], [_entry(1, 10.0, None, "queued")], rows=left))


def test_the_checks_catch_a_join_released_early_twice_or_with_wrong_inputs() -> None:
    """A join released before an input is done, released twice, or whose run read other results
    than its inputs' breaks the workflow's promise; a join cancelled with its input must not run."""
    log = _attempt(1, 10.0, 11.0) + _attempt(2, 10.0, 12.0)
    join = [_entry(3, 9.0, None, "waiting"), _entry(3, 12.0, "waiting", "queued")]
    join += _attempt(3, 12.5, 13.5)
    inputs = [{"task_id": t, "attempt": 1, "worker_id": W1} for t in (1, 2)]
    runs = [_run(1, 1, 10.1, 10.9), _run(2, 2, 10.1, 11.9), _run(3, 3, 12.6, 13.4)]
    runs[2].inputs = inputs
    flow = {"inputs": [1, 2], "join": 3}
    check_workflow(_made_up(runs, log + join, flow=flow))
    runs[2].inputs = inputs[::-1]
    with pytest.raises(Broken, match="reads its inputs' results in order"):
        check_workflow(_made_up(runs, log + join, flow=flow))
    runs[2].inputs = inputs
    early = [_entry(3, 9.0, None, "waiting"), _entry(3, 11.5, "waiting", "queued")]
    with pytest.raises(Broken, match="once its inputs are all done"):
        check_workflow(_made_up(runs, log + early + join[2:], flow=flow))
    # One statement acknowledged input 2 and released the join: the trigger logged the join's
    # change first (inside the statement), the input's at the statement's end. Not early.
    same = _attempt(1, 10.0, 11.0) + _attempt(2, 10.0, 12.0, stmt=11.9)
    inside = [_entry(3, 9.0, None, "waiting"), _entry(3, 11.95, "waiting", "queued", stmt=11.9)]
    check_workflow(_made_up(runs, same + inside + join[2:], flow=flow))
    twice = [*join[:2], _entry(3, 12.1, "queued", "waiting"), _entry(3, 12.2, "waiting", "queued")]
    with pytest.raises(Broken, match="a join is released once"):
        check_workflow(_made_up(runs, log + twice + join[2:], flow=flow))
    rows = {
        t: {"state": "done", "attempts": 1, "worker_id": W1, "result": None, "last_error": None}
        for t in (1, 2)
    }
    rows[3] = {**rows[1], "state": "cancelled", "last_error": "DependencyFailed: step 2 (mx)"}
    with pytest.raises(Broken, match="a cancelled input cancels the join"):
        check_workflow(_made_up(runs, log + join, flow=flow, rows=rows))
    check_workflow(_made_up(runs[:2], log + join[:1], flow=flow, rows=rows))
