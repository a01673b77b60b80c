-- The embedded server: who is attached to it.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: embedded_attached_workers
-- Worker processes connected to the server, per database: each worker process has one main
-- connection named exactly "worker" (the claim loop); its other connections (worker-lease,
-- worker-maintenance, ...), waiters, the metrics server and the CLI use other names.
SELECT coalesce(datname, '?') AS database, count(*) AS workers
  FROM pg_stat_activity
 WHERE application_name = 'worker'
   AND pid <> pg_backend_pid()
 GROUP BY datname
 ORDER BY datname;
