-- The metrics journal's reads of transaction status.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: metrics_current_xact_id
SELECT pg_current_xact_id()::text AS xid;

-- name: metrics_xact_status
-- 'committed', 'aborted' or 'in progress'; NULL when the id is too old to be known.
SELECT pg_xact_status(%(xid)s::xid8) AS status;
