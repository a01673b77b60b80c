-- `worker embedded`: questions about the embedded server itself, in any of its databases.

-- name: embedded_attached_workers
-- Worker processes connected to the server, per database: each worker process has one main
-- connection named exactly "worker" (_worker.py); its other connections (worker-lease,
-- worker-maintenance, ...), waiters, the metrics server and the CLI use other names.
SELECT coalesce(datname, '?') AS database, count(*) AS workers
  FROM pg_stat_activity
 WHERE application_name = 'worker'
   AND pid <> pg_backend_pid()
 GROUP BY datname
 ORDER BY datname;
