-- The operator console's actions (worker/_console_actions.py): many tasks at once by id, the
-- deletion of tasks, and the record of what operators did. The console picks the ids (at most a
-- few thousand per action) from its job browser; each statement re-checks every row's state, so
-- a row that moved on since it was listed is left alone.

-- name: retry_tasks
-- Failed or cancelled tasks among %(ids)s back to queued, due now, with fresh attempts (as
-- retry_task does for one). A task whose dedupe key a scheduled, queued or running task holds
-- stays as it is, as does every one of the batch but the oldest that share a key; they are
-- counted as skipped. (A producer that takes a key between the check and the update raises a
-- unique violation; the caller runs the statement again.)
WITH batch AS (
    SELECT t.id, t.finished_at, t.dedupe_key
      FROM {schema}.tasks AS t
     WHERE t.id = ANY(%(ids)s::bigint[]) AND t.state IN ('failed', 'cancelled')
       FOR UPDATE
),
checked AS (
    SELECT b.id,
           b.dedupe_key IS NOT NULL
           AND (row_number() OVER (PARTITION BY b.dedupe_key ORDER BY b.finished_at, b.id) > 1
                OR EXISTS (SELECT 1 FROM {schema}.tasks AS h
                            WHERE h.dedupe_key = b.dedupe_key
                              AND h.state IN ('scheduled', 'queued', 'in_progress'))) AS taken
      FROM batch AS b
),
moved AS (
    UPDATE {schema}.tasks AS t
       SET state = 'queued', run_at = now(), attempts = 0, finished_at = NULL,
           lease_expires_at = NULL, cancel_requested_at = NULL, cancelled_by = NULL
     WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken))
    RETURNING t.id
)
SELECT (SELECT count(*) FROM moved) AS requeued,
       (SELECT count(*) FROM checked WHERE taken) AS skipped;

-- name: delete_tasks
-- Delete the tasks among %(ids)s that no worker is running (a running task's worker would find
-- its row gone: cancel it or let it finish first); returns how many.
WITH gone AS (
    DELETE FROM {schema}.tasks AS t
     WHERE t.id = ANY(%(ids)s::bigint[]) AND t.state <> 'in_progress'
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: console_audit_insert
-- One action taken from the console (schema/0009).
INSERT INTO {schema}.console_audit (actor, address, action, target, affected)
VALUES (%(actor)s, %(address)s, %(action)s, %(target)s, %(affected)s);

-- name: console_audit_recent
-- The newest %(limit)s actions, read backwards from console_audit_at_idx.
SELECT id, at, actor, address, action, target, affected
  FROM {schema}.console_audit
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;
