-- Cancel requests: how a worker that cannot LISTEN learns of them (schema/0010).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

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
