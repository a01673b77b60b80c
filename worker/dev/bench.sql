-- `worker bench`: the bare-SQL ceiling and the phases' reads.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: bench_claim
-- The ceiling's claim: the worker's claim shape over queued rows, and nothing more (no cursor,
-- no per-handler max_attempts, only the ids back). It is a ceiling, not the product.
WITH picked AS (
    SELECT id
      FROM {schema}.tasks
     WHERE state = 'queued' AND queue = %(queue)s AND run_at <= now()
     ORDER BY (-priority), run_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.tasks AS t
   SET state = 'in_progress', attempts = t.attempts + 1, worker_id = %(worker_id)s,
       started_at = now(), lease_expires_at = now() + interval '30 seconds'
 WHERE t.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING t.id;

-- name: bench_ack
-- The ceiling's acknowledgement, in the same transaction as its next claim.
UPDATE {schema}.tasks
   SET state = 'done', finished_at = now(), lease_expires_at = NULL
 WHERE id = ANY(%(ids)s::bigint[]);

-- name: bench_ack_delete
-- The same, when the worker keeps no finished rows (--keep-done 0) and deletes them instead.
DELETE FROM {schema}.tasks
 WHERE id = ANY(%(ids)s::bigint[]);

-- name: bench_fill_finished
-- Old finished rows, as a busy queue accumulates between purges: they must not slow claims.
INSERT INTO {schema}.tasks (task, state, attempts, started_at, finished_at)
SELECT 'bench.old', 'done', 1, now() - interval '10 minutes', now() - interval '9 minutes'
  FROM generate_series(1, %(n)s);

-- name: bench_fill_history
-- The same rows in the history (--keep-history), as an hour of a busy queue leaves them there:
-- the task table stays empty of them, and only the acknowledgement's move writes to the history.
-- Ids from the task table's sequence, as the acknowledgement's move keeps them.
INSERT INTO {schema}.task_history (id, queue, task, state, attempts, started_at, finished_at, slot)
SELECT nextval(pg_get_serial_sequence(format('%%I.tasks', %(schema)s::text), 'id')), 'default',
       'bench.old', 'done', 1, now() - interval '10 minutes', now() - interval '9 minutes',
       (SELECT h.slot FROM {schema}.history_slots AS h WHERE h.state = 'current')
  FROM generate_series(1, %(n)s);

-- name: bench_history_rows
-- Whether the history holds rows already (filled once: nothing of the bench empties it).
SELECT EXISTS (SELECT 1 FROM {schema}.task_history);

-- name: bench_fill_delayed
-- Tasks due tomorrow in the queue under test, as any producer's delayed tasks would be: plain rows
-- of the task table, written by one statement.
INSERT INTO {schema}.tasks (task, queue, run_at)
SELECT 'bench.noop', %(queue)s, now() + interval '1 day'
  FROM generate_series(1, %(n)s);

-- name: bench_workers_alive
SELECT count(*) FROM {schema}.workers WHERE stopped_at IS NULL;

-- name: bench_last_id
-- The last id handed out so far (0 if none): a light-load phase's tasks are the ids after it. With
-- --keep-history, done tasks of earlier phases (and --finished rows) are still in the history.
SELECT coalesce(pg_sequence_last_value(
           pg_get_serial_sequence(format('%%I.tasks', %(schema)s::text), 'id')::regclass), 0);

-- name: bench_done
-- Done tasks of the queue enqueued by this phase (ids after %(after)s), wherever they finished (the
-- task table or the history, schema/0025): a range of the primary keys, whatever else they hold.
SELECT count(*) FROM {schema}.task_rows
 WHERE state = 'done' AND queue = %(queue)s AND id > %(after)s;

-- name: bench_latency
-- The light-load phases: from enqueue to claim, both read from the database clock (created_at is
-- the producer's INSERT transaction time, started_at the claiming transaction's), in milliseconds.
SELECT count(*) AS n,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
           * 1000 AS p50_ms,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
           * 1000 AS p99_ms,
       max(extract(epoch FROM started_at - created_at)) * 1000 AS max_ms
  FROM {schema}.task_rows
 WHERE state = 'done' AND queue = %(queue)s AND id > %(after)s;

-- name: bench_claim_backends
-- The server processes of the worker's connections: claims ('worker'), the lease keeper and the
-- maintenance thread ('worker-lease', 'worker-maintenance'), so that work moved off the claim
-- path still counts. The light-load phases read their CPU time from /proc when the server runs
-- on this machine. Other workers on the same database would be counted too: bench alone.
SELECT pid FROM pg_stat_activity
 WHERE datname = current_database()
   AND (application_name = 'worker' OR application_name LIKE 'worker-%%');

-- name: bench_server_is_local
-- NULL over a Unix socket.
SELECT coalesce(host(inet_server_addr()) IN ('127.0.0.1', '::1'), true);

-- name: bench_wal_position
-- Bytes of WAL written so far (where the next record goes), to count what a phase writes. Other
-- sessions' writes count too: bench alone.
SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint;
