-- `worker bench --soak`: what the soak reads each minute. Reads only: the producer enqueues
-- through the store (enqueue_many), the real worker does the rest.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: soak_last_id
-- The id of the last task the producer's connection enqueued (it is the only producer): the
-- minutes are id ranges, so a minute's tasks are read by primary key whatever the table holds.
SELECT currval(pg_get_serial_sequence(format('%%I.tasks', %(schema)s::text), 'id'));

-- name: soak_latency
-- Enqueue to claim, in milliseconds, of every %(step)s-th task with an id in (%(lo)s, %(hi)s],
-- from the database clock on both ends (created_at: the producer's transaction; started_at: the
-- claim's). A task not claimed yet counts as waiting until now (a lower bound: a backlog shows),
-- and says so. Finished tasks may be in the history (--keep-history): read through task_rows.
SELECT extract(epoch FROM coalesce(t.started_at, statement_timestamp()) - t.created_at)
           * 1000 AS ms,
       t.started_at IS NULL AS unclaimed
  FROM generate_series(%(lo)s::bigint + 1, %(hi)s::bigint, %(step)s::bigint) AS g(id)
  JOIN {schema}.task_rows AS t ON t.id = g.id;

-- name: soak_first_id
-- The last id handed out before the soak (0 if none): its first minute starts after it.
SELECT coalesce(pg_sequence_last_value(
           pg_get_serial_sequence(format('%%I.tasks', %(schema)s::text), 'id')::regclass), 0);

-- name: soak_table
-- The task table now: heap and index sizes, dead and live row versions, and the vacuums so far
-- (autovacuum's, and the others': the worker's own VACUUM between autovacuum's rounds).
SELECT pg_relation_size(s.relid) AS heap_bytes,
       pg_indexes_size(s.relid) AS index_bytes,
       pg_total_relation_size(s.relid) AS total_bytes,
       s.n_dead_tup AS dead_rows,
       s.n_live_tup AS live_rows,
       s.autovacuum_count AS autovacuums,
       s.vacuum_count AS vacuums,
       s.autoanalyze_count AS autoanalyzes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal_bytes,
       -- The history's partitions (--keep-history), heap, indexes and TOAST.
       (SELECT coalesce(sum(pg_total_relation_size(h.relid)), 0)::bigint
          FROM pg_partition_tree(format('%%I.task_history', %(schema)s::text)::regclass) AS h)
           AS history_bytes
  FROM pg_stat_user_tables AS s
 WHERE s.relid = format('%%I.tasks', %(schema)s::text)::regclass;

-- name: soak_vacuuming
-- Vacuums of the task table running now, by process, and whether autovacuum runs it: sampled
-- every half second, how long each run lasts (a run shorter than that may go unseen; the counts
-- of soak_table do not miss it).
SELECT p.pid, a.backend_type = 'autovacuum worker' AS auto
  FROM pg_stat_progress_vacuum AS p
  JOIN pg_stat_activity AS a ON a.pid = p.pid
 WHERE p.relid = format('%%I.tasks', %(schema)s::text)::regclass;

-- name: soak_backlog
-- Tasks waiting at the end of a minute, counted up to a cap: 0 while the worker keeps up. Read
-- by primary key among the last ids the producer was given (after %(after)s, the cap's worth):
-- the worker claims in order of run_at and id, so a task older than those waiting means they
-- all wait, and the count is the cap. Not from the claim index, whose dead entries (millions
-- while a transaction is held) a count there walks every minute, on the cores the soak measures.
SELECT count(*) FROM {schema}.tasks WHERE id > %(after)s AND state = 'queued';

-- name: soak_settings
SELECT current_setting('autovacuum') AS autovacuum,
       current_setting('autovacuum_naptime') AS autovacuum_naptime,
       current_setting('autovacuum_vacuum_cost_limit') AS autovacuum_vacuum_cost_limit,
       current_setting('shared_buffers') AS shared_buffers,
       current_setting('max_wal_size') AS max_wal_size,
       (SELECT coalesce(array_to_string(c.reloptions, ', '), '')
          FROM pg_class AS c WHERE c.oid = format('%%I.tasks', %(schema)s::text)::regclass)
           AS table_options;

-- name: soak_backend_pid
SELECT pg_backend_pid();
