-- Cancelling tasks (schema/0010; worker/_cancel.py). Each block starts with `-- name: NAME`;
-- {schema} is the quoted schema name; values are bound.

-- name: cancel_tasks
-- Cancel each of %(ids)s, for %(by)s (NULL: the database role): a task that has not started is
-- cancelled at once, a running one is marked and its worker told (NOTIFY). One row per id, in
-- the order given: (id, outcome, state); see the function in schema/0010 for the outcomes. The
-- same function serves psql users, so Python and SQL cancel alike.
SELECT c.id, c.outcome, c.state
  FROM {schema}.cancel_tasks(%(ids)s::bigint[], %(by)s::text) AS c;

-- name: cancel_requests
-- The lease keeper's fallback when no LISTEN connection is up (PgBouncer in transaction mode,
-- --no-listen, or LISTEN being made again): which of the rows this worker holds someone asked
-- to cancel. A read by primary key, once a second while the worker holds rows and cannot listen.
SELECT t.id
  FROM {schema}.tasks AS t
 WHERE t.id = ANY(%(ids)s::bigint[])
   AND t.worker_id = %(worker_id)s
   AND t.cancel_requested_at IS NOT NULL
   AND t.lease_expires_at IS NOT NULL;  -- in progress (see complete in tasks.sql)
