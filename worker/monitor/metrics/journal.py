"""Exact task metrics across a SIGKILL: the journal a supervised worker keeps of its last commit.

A worker counts a claim or an acknowledgement after its transaction commits. A child killed
between the COMMIT and the counting (an OOM kill, a deploy's SIGKILL) would lose those counts, and
the supervisor's totals would drift from the task table. So, before each COMMIT that changes its
task metrics, a child writes one small file: the transaction id and the values its task metrics
will have once the transaction is counted. When the child dies, the supervisor asks the database
whether that transaction committed (``pg_xact_status``) and, if it did, adds whatever the dead
child's metric files are short of. Records go alternately to two files, each with a sequence
number and a checksum, so a kill in the middle of a write leaves the previous record readable and
the torn one rejected; every case comes out exact:

* killed before COMMIT was sent: the transaction aborts and nothing is added;
* killed after COMMIT, before counting: the record's values are added;
* killed after counting (or halfway through): only what is missing is added.

Journaled: the task counters (claimed, completed, retried, failed, rescued) and the claim latency
and batch size histograms, which count claims. Durations are observed before the acknowledgement's
COMMIT and other counters (database errors, locks, cron) may miss a killed child's last event.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from ...db.connect import JOURNAL, connect
from ...db.sql import queries
from .instruments import instruments

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

log = logging.getLogger("worker.metrics")

# (metric name, part, label values, le): part is "total" for a counter, "bucket" (one bucket, not
# cumulative, with its le) or "sum" for a histogram.
Sample = tuple[str, str, tuple[str, ...], str]

# Journaled metric -> (attribute of _metrics._Instruments, label names).
JOURNALED: dict[str, tuple[str, tuple[str, ...]]] = {
    "worker_tasks_claimed": ("claimed", ("queue", "task")),
    "worker_tasks_completed": ("completed", ("queue", "task")),
    "worker_tasks_retried": ("retried", ("queue", "task")),
    "worker_tasks_failed": ("failed", ("queue", "task")),
    "worker_tasks_rescued": ("rescued", ("queue", "task")),
    "worker_task_latency_seconds": ("latency", ("queue", "task")),
    "worker_claim_batch_size": ("batch", ("queue",)),
}


# Each record: sequence number, payload length, CRC-32 of the payload, then the JSON payload.
_HEADER = struct.Struct("<QII")


def journal_paths(directory: str, pid: int) -> tuple[str, str]:
    return (
        os.path.join(directory, f"journal_{pid}.a"),
        os.path.join(directory, f"journal_{pid}.b"),
    )


def _read_record(directory: str, pid: int) -> dict[str, Any] | None:
    """The newest intact record of the two files, or None."""
    best: tuple[int, bytes] | None = None
    for path in journal_paths(directory, pid):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if len(data) < _HEADER.size:
            continue
        seq, length, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size : _HEADER.size + length]
        if (
            len(payload) == length
            and zlib.crc32(payload) == crc
            and (best is None or seq > best[0])
        ):
            best = (seq, payload)
    if best is None:
        return None
    try:
        record = json.loads(best[1])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _remove(directory: str, pid: int) -> None:
    for path in journal_paths(directory, pid):
        with contextlib.suppress(OSError):
            os.unlink(path)


def counter_samples(metric: str, key: tuple[str, ...], n: float) -> list[tuple[Sample, float]]:
    return [((metric, "total", key, ""), n)]


def histogram_samples(
    metric: str,
    key: tuple[str, ...],
    bounds: Sequence[float],
    counts: dict[int, int],
    total: float,
) -> list[tuple[Sample, float]]:
    """The bucket and sum increments of an observation batch (see ``bucket_counts``)."""
    from prometheus_client.utils import floatToGoString

    out: list[tuple[Sample, float]] = [
        ((metric, "bucket", key, floatToGoString(bounds[i])), n) for i, n in counts.items()
    ]
    out.append(((metric, "sum", key, ""), total))
    return out


class Journal:
    """The child's side: what its metric files hold, and the record written before COMMIT."""

    def __init__(self, directory: str, pid: int) -> None:
        self._fds = [
            os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in journal_paths(directory, pid)
        ]
        # Sequence numbers from the system-wide monotonic clock: higher than any left by a dead
        # process of this run that had the same pid (the supervisor may still be settling it).
        self._seq = time.monotonic_ns()
        # This process is the only writer of its metric files, which start empty unless a dead
        # process of this run had the same pid.
        self.totals: dict[Sample, float] = read_samples(directory, pid)

    def write(self, xid: str, samples: list[tuple[Sample, float]]) -> None:
        targets: dict[Sample, float] = {}
        for sample, n in samples:
            targets[sample] = targets.get(sample, self.totals.get(sample, 0.0)) + n
        record = {"xid": xid, "values": [[*s[:2], list(s[2]), s[3], v] for s, v in targets.items()]}
        payload = json.dumps(record).encode()
        self._seq += 1
        # One write to a file opened once: no rename, no fsync (a killed process's writes are in
        # the page cache; a machine crash takes the supervisor and its metrics along anyway).
        header = _HEADER.pack(self._seq, len(payload), zlib.crc32(payload))
        os.pwrite(self._fds[self._seq % 2], header + payload, 0)

    def add(self, samples: list[tuple[Sample, float]]) -> None:
        """The samples were applied to the metric files."""
        totals = self.totals
        for sample, n in samples:
            totals[sample] = totals.get(sample, 0.0) + n


def read_samples(directory: str, pid: int) -> dict[Sample, float]:
    """The journaled metrics as one process's files hold them, read with prometheus-client's own
    reader pointed at copies of just those files."""
    from prometheus_client import multiprocess

    values: dict[Sample, float] = {}
    sources = [os.path.join(directory, f"{kind}_{pid}.db") for kind in ("counter", "histogram")]
    sources = [s for s in sources if os.path.exists(s)]
    if not sources:
        return values
    with tempfile.TemporaryDirectory(prefix="worker-journal-") as scratch:
        for source in sources:
            shutil.copy(source, scratch)
        families = list(multiprocess.MultiProcessCollector(None, path=scratch).collect())
    for family in families:
        spec = JOURNALED.get(family.name)
        if spec is None:
            continue
        names = spec[1]
        cumulative: dict[tuple[str, ...], list[tuple[float, str, float]]] = {}
        for s in family.samples:
            key = tuple(s.labels.get(n, "") for n in names)
            if s.name.endswith("_total"):
                values[(family.name, "total", key, "")] = s.value
            elif s.name.endswith("_sum"):
                values[(family.name, "sum", key, "")] = s.value
            elif s.name.endswith("_bucket"):
                le = s.labels["le"]
                cumulative.setdefault(key, []).append((float(le), le, s.value))
        for key, buckets in cumulative.items():
            below = 0.0
            for _, le, v in sorted(buckets):
                values[(family.name, "bucket", key, le)] = v - below
                below = v
    return values


def settle(pid: int, directory: str, dsn: str, schema: str, *, timeout: float = 300.0) -> float:
    """The supervisor's side, for a child that is gone: add what its last committed transaction
    changed and it did not count. Returns the number of task events (counter increments) added.

    The supervisor must be in multiprocess mode: its increments land in its own files in
    ``directory``, summed with the children's. Waits while the transaction is still in progress
    (the server has not yet noticed the child is gone) and, up to ``timeout`` seconds, while the
    database is unreachable.
    """
    record = _read_record(directory, pid)
    if record is None:
        _remove(directory, pid)
        return 0.0
    added = 0.0
    status = _transaction_status(dsn, schema, str(record["xid"]), timeout)
    if status == "committed":
        m = instruments()
        have = read_samples(directory, pid)
        for metric, part, key, le, target in record["values"]:
            sample: Sample = (metric, part, tuple(key), le)
            missing = float(target) - have.get(sample, 0.0)
            if missing > 0 and metric in JOURNALED:
                _add(m, sample, missing)
                if part == "total":
                    added += missing
    elif status is None:
        log.warning("could not learn whether worker pid %d's last transaction committed", pid)
    _remove(directory, pid)
    if added:
        log.info("counted %d task event(s) worker pid %d committed but did not count", added, pid)
    return added


def _add(m: Any, sample: Sample, amount: float) -> None:
    metric, part, key, le = sample
    child = getattr(m, JOURNALED[metric][0]).labels(*key)
    if part == "total":
        child.inc(amount)
        return
    # A histogram has no public way to add to one bucket or to the sum alone; these are the
    # internals its own observe() uses (as _metrics._observe_many does).
    bounds = getattr(child, "_upper_bounds", None)
    target = getattr(child, "_sum", None)
    if part == "bucket" and bounds is not None:
        target = child._buckets[bounds.index(float(le))]
    if target is None:
        log.warning("cannot settle %s on this prometheus-client version", metric)
        return
    target.inc(amount)


def _transaction_status(dsn: str, schema: str, xid: str, timeout: float) -> str | None:
    query = queries(schema, SQL_DIR)["metrics_xact_status"]
    deadline = time.monotonic() + timeout
    while True:
        try:
            with connect(dsn, JOURNAL) as conn:
                while True:
                    row = conn.execute(query, {"xid": xid}).fetchone()
                    status = row[0] if row else None
                    if status != "in progress" or time.monotonic() > deadline:
                        return status
                    time.sleep(0.1)
        except psycopg.Error:
            if time.monotonic() > deadline:
                return None
            time.sleep(1.0)
