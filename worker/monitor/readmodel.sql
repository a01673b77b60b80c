-- Reads of the status page and the queue gauges.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: metrics_state_estimates
-- Rows per state across the whole table and the history's slots (schema/0025), from the
-- planner's statistics (reltuples times the most-common-value frequencies that ANALYZE keeps for
-- `state`): free to read, as fresh as the last autovacuum/analyze, and empty until the table has
-- been analyzed once. An emptied slot counts nothing (its reltuples is unknown until analyzed).
SELECT v.state, sum(greatest(c.reltuples, 0) * v.freq)::float8 AS estimate
  FROM pg_class AS c
  JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
 CROSS JOIN LATERAL (
    SELECT unnest(s.most_common_vals::text::text[]) AS state,
           unnest(s.most_common_freqs) AS freq
      FROM pg_stats AS s
     WHERE s.schemaname = ns.nspname AND s.tablename = c.relname AND s.attname = 'state'
 ) AS v
 WHERE ns.nspname = %(schema)s
   AND (c.relname = 'tasks'
        OR c.oid IN (SELECT i.inhrelid FROM pg_inherits AS i
                      WHERE i.inhparent = to_regclass(format('%%I.task_history', %(schema)s))))
 GROUP BY v.state;

-- name: status_page_cron_runs
-- The latest slot of each cron key still in the table (at most %(limit)s keys): a skip scan of
-- tasks_cron_slot_idx, one probe per key, so a day of minutely slots costs what one slot does.
WITH RECURSIVE keys AS (
    (SELECT t.cron_key, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.cron_key IS NOT NULL ORDER BY t.cron_key LIMIT 1)
    UNION ALL
    SELECT (SELECT t.cron_key FROM {schema}.tasks AS t
             WHERE t.cron_key > k.cron_key ORDER BY t.cron_key LIMIT 1),
           k.depth + 1
      FROM keys AS k
     WHERE k.cron_key IS NOT NULL AND k.depth < %(limit)s
)
SELECT last.cron_key, last.cron_at, last.state::text AS state, last.finished_at
  FROM keys
 CROSS JOIN LATERAL (
    SELECT t.cron_key, t.cron_at, t.state, t.finished_at FROM {schema}.tasks AS t
     WHERE t.cron_key = keys.cron_key
     ORDER BY t.cron_at DESC
     LIMIT 1
 ) AS last
 WHERE keys.cron_key IS NOT NULL
 ORDER BY last.cron_key;

-- name: status_page_table_exists
SELECT to_regclass(%(name)s) IS NOT NULL;

-- name: status_page_cron_schedules
-- Only run after status_page_table_exists said yes: the cron table belongs to the cron feature
-- and its columns are rendered as they are.
SELECT to_jsonb(c) AS row FROM {schema}.cron_schedules AS c LIMIT %(limit)s;

-- name: status_page_locks
-- Same as above for the lock table.
SELECT to_jsonb(l) AS row FROM {schema}.locks AS l LIMIT %(limit)s;

-- name: status_page_advisory_locks
-- Advisory locks granted in this database. pg_locks is not free on a busy server, which is why
-- only the status page (cached, on demand) reads it, never /metrics.
SELECT l.classid::bigint AS classid, l.objid::bigint AS objid, l.objsubid, l.mode, l.pid,
       a.application_name, a.client_addr::text AS client_addr, a.state,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_seconds
  FROM pg_locks AS l
  LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY l.pid, l.classid, l.objid
 LIMIT %(limit)s;
