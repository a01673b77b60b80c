-- The checks of `worker doctor`.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: doctor_settings
-- The settings the checks compare against, as text (the caller converts), plus who we are.
SELECT s.name, s.setting
  FROM pg_settings AS s
 WHERE s.name IN ('max_connections', 'superuser_reserved_connections', 'reserved_connections',
                  'autovacuum', 'autovacuum_naptime', 'autovacuum_vacuum_threshold',
                  'autovacuum_vacuum_scale_factor', 'max_prepared_transactions', 'wal_level',
                  'server_version_num', 'track_counts')
UNION ALL
SELECT 'backend_pid', pg_backend_pid()::text
UNION ALL
-- Without pg_read_all_stats (or superuser), the sessions of other roles show no xmin, state or
-- query: the horizon check cannot see them.
SELECT 'sees_all_sessions',
       (pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')
        OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user))::text;

-- name: doctor_sessions
-- Sessions that hold the xmin horizon back (a snapshot, or a transaction id) or sit idle in a
-- transaction, oldest transaction first. Since PostgreSQL 14 a snapshot taken in another database
-- does not hold this database's horizon; a transaction id does, whichever database it is in (it
-- stays in every snapshot's list of running transactions). Autovacuum's own snapshot never holds
-- it (other vacuums ignore it). Our own session is left out.
SELECT a.pid, a.datname, a.usename, a.application_name, a.client_addr::text AS client_addr,
       a.backend_type, a.state, a.backend_xid::text AS backend_xid,
       a.backend_xmin::text AS backend_xmin,
       greatest(age(a.backend_xid), age(a.backend_xmin)) AS xid_age,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_seconds,
       extract(epoch FROM now() - a.state_change)::float8 AS state_seconds,
       left(a.query, 4000) AS query,
       (a.backend_xid IS NOT NULL
        OR a.datname IS NULL
        OR a.datname = current_database()
        OR current_setting('server_version_num')::int < 140000)
       AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL) AS holds
  FROM pg_stat_activity AS a
 WHERE a.pid <> pg_backend_pid()
   AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
   AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL
        OR a.state IN ('idle in transaction', 'idle in transaction (aborted)'))
 ORDER BY a.xact_start NULLS LAST, a.pid
 LIMIT %(limit)s;

-- name: doctor_hidden_sessions
-- Sessions of other roles whose details this role may not see (their backend_xid and backend_xmin
-- stay visible, so doctor_sessions still finds them, judged by xid age for want of a start time).
-- Background processes without a user are not counted.
SELECT count(*) AS hidden
  FROM pg_stat_activity AS a
 WHERE a.usesysid IS NOT NULL
   AND a.query = '<insufficient privilege>';

-- name: doctor_prepared
-- Prepared transactions, oldest first: each keeps its transaction id (so the horizon, in every
-- database) and its locks until someone commits or rolls it back by its gid.
SELECT p.gid, p.database, p.owner,
       extract(epoch FROM now() - p.prepared)::float8 AS prepared_seconds,
       age(p.transaction) AS xid_age
  FROM pg_prepared_xacts AS p
 ORDER BY p.prepared
 LIMIT %(limit)s;

-- name: doctor_slots
-- Replication slots: xmin holds the horizon of every table (a standby's hot_standby_feedback),
-- catalog_xmin that of the system catalogs (logical decoding); restart_lsn keeps WAL on disk.
SELECT r.slot_name, r.slot_type, r.database, r.active, r.active_pid,
       r.xmin::text AS xmin, r.catalog_xmin::text AS catalog_xmin,
       age(r.xmin) AS xmin_age, age(r.catalog_xmin) AS catalog_xmin_age,
       CASE WHEN r.restart_lsn IS NOT NULL AND NOT pg_is_in_recovery()
            THEN pg_wal_lsn_diff(pg_current_wal_lsn(), r.restart_lsn)::float8 END
           AS retained_bytes,
       r.wal_status
  FROM pg_replication_slots AS r
 ORDER BY greatest(age(r.xmin), age(r.catalog_xmin)) DESC NULLS LAST, r.slot_name
 LIMIT %(limit)s;

-- name: doctor_tables
-- The queue's tables with their dead row versions, sizes, last vacuums and autovacuum settings,
-- and how many indexes each has.
-- pg_table_size and pg_indexes_size read file sizes (they take an AccessShareLock, which only an
-- ALTER TABLE or VACUUM FULL would make them wait for: hence the caller's lock_timeout).
SELECT s.relname AS name, s.n_live_tup AS live, s.n_dead_tup AS dead,
       extract(epoch FROM now() - s.last_vacuum)::float8 AS vacuum_seconds,
       extract(epoch FROM now() - s.last_autovacuum)::float8 AS autovacuum_seconds,
       s.vacuum_count, s.autovacuum_count,
       pg_table_size(s.relid) AS table_bytes, pg_indexes_size(s.relid) AS index_bytes,
       (SELECT count(*) FROM pg_index AS i WHERE i.indrelid = s.relid) AS index_count,
       greatest(c.reltuples, 0)::float8 AS reltuples,
       coalesce(c.reloptions, '{}') AS reloptions
  FROM pg_stat_user_tables AS s
  JOIN pg_class AS c ON c.oid = s.relid
 WHERE s.schemaname = %(schema)s
 ORDER BY s.n_dead_tup DESC, s.relname
 LIMIT %(limit)s;

-- name: doctor_connections
-- Client connections (the ones max_connections limits), how many are the fleet's (worker
-- processes, the metrics server: application_name worker...), and how many sit idle in a
-- transaction. The backend_type of another role's session is hidden from a role without
-- pg_read_all_stats: a session with a user and no visible type counts as a client.
SELECT count(*) AS used,
       count(*) FILTER (WHERE a.application_name = 'worker'
                            OR a.application_name LIKE 'worker-%%') AS fleet,
       count(*) FILTER (WHERE a.datname = current_database()) AS this_database,
       count(*) FILTER (WHERE a.state IN ('idle in transaction',
                                          'idle in transaction (aborted)')) AS idle_in_transaction
  FROM pg_stat_activity AS a
 WHERE a.backend_type = 'client backend'
    OR (a.backend_type IS NULL AND a.usesysid IS NOT NULL);

-- name: doctor_running
-- In-progress tasks (at most %(cap)s of them, through the lease index): how many have run longer
-- than %(long_seconds)s, how many have a lease that expired more than %(grace_seconds)s ago (the
-- rescue of every live worker should have put them back), and the oldest of each.
WITH running AS (
    SELECT t.started_at, t.lease_expires_at
      FROM {schema}.tasks AS t
     WHERE t.state = 'in_progress'
     LIMIT %(cap)s
)
SELECT count(*) AS running,
       count(*) FILTER (WHERE started_at < now() - make_interval(secs => %(long_seconds)s))
           AS long_running,
       count(*) FILTER (WHERE lease_expires_at < now() - make_interval(secs => %(grace_seconds)s))
           AS expired,
       extract(epoch FROM now() - min(started_at))::float8 AS oldest_seconds,
       extract(epoch FROM now() - min(lease_expires_at))::float8 AS most_expired_seconds,
       count(*) >= %(cap)s AS capped
  FROM running;

-- name: doctor_running_sample
-- The first few of them, oldest start first, to name in the finding.
SELECT r.id, left(r.task, 200) AS task, left(r.queue, 200) AS queue, r.worker_id::text AS worker_id,
       r.attempts, extract(epoch FROM now() - r.started_at)::float8 AS running_seconds,
       extract(epoch FROM now() - r.lease_expires_at)::float8 AS expired_seconds
  FROM (SELECT t.id, t.task, t.queue, t.worker_id, t.attempts, t.started_at, t.lease_expires_at
          FROM {schema}.tasks AS t
         WHERE t.state = 'in_progress'
         LIMIT %(cap)s) AS r
 WHERE r.started_at < now() - make_interval(secs => %(long_seconds)s)
    OR r.lease_expires_at < now() - make_interval(secs => %(grace_seconds)s)
 ORDER BY r.started_at
 LIMIT %(limit)s;

-- name: doctor_claim_probe
-- The read-only twin of the claim's scan (store/claims.sql, claim): the first due rows of one
-- queue in claim order, from the start of the queue's range in tasks_claim_idx, with no lock.
-- Under EXPLAIN (ANALYZE, BUFFERS) it shows what a claim walks to find them.
SELECT t.id
  FROM {schema}.tasks AS t
 WHERE t.state = 'queued' AND t.queue = %(queue)s AND t.run_at <= now()
 ORDER BY (-t.priority), t.run_at, t.id
 LIMIT %(limit)s;

-- name: doctor_worker_plans
-- For the rest of the transaction: plan as a worker's own connection does (session_index_plans
-- in tasks.sql rules sequential scans out there), so the probe measures the claim workers run.
SELECT set_config('enable_seqscan', 'off', true);

-- name: doctor_local_timeouts
-- For the rest of the transaction: no check waits long for a statement or a lock, and no JIT.
SELECT set_config('statement_timeout', %(statement_ms)s, true),
       set_config('lock_timeout', %(lock_ms)s, true),
       set_config('jit', 'off', true);
