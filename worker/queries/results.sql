-- Results and waiting (worker/_results.py, worker/_wait.py).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: complete_with_result
-- `complete` (queries/tasks.sql) for the rows whose handler returned a result to store: the same
-- fencing, word for word, plus the result. Run in the same acknowledging transaction as
-- `complete`, and only when the batch holds such rows, so that tasks which store nothing keep
-- the acknowledgement they had. Results arrive as JSON text, checked by the worker (see
-- _results.encode_result), and are cast here. A row someone asked to cancel ends 'cancelled'
-- and keeps no result, as in `complete`.
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'done'::{schema}.task_state
                    ELSE 'cancelled' END,
       finished_at = now(), lease_expires_at = NULL,
       result = CASE WHEN t.cancel_requested_at IS NULL THEN a.result::jsonb END
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(results)s::text[])
       AS a(id, attempt, result)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
RETURNING t.id, t.state::text AS state;

-- name: notify_done
-- Wake whoever waits on these tasks (comma-separated ids, under 8,000 bytes: the caller splits
-- longer lists). Sent inside the transaction that finished them, so it arrives only once their
-- new state is visible, and never if that transaction rolls back.
SELECT pg_notify(%(channel)s, %(ids)s);

-- name: task_outcomes
-- Where these tasks stand, for waiters: one primary-key look-up per id (array text, see
-- _transitions.int_array). A task missing from the answer does not exist (any more).
SELECT t.id, t.state::text, t.result, t.last_error
  FROM {schema}.tasks AS t
 WHERE t.id = ANY(%(ids)s::bigint[]);
