-- 0007: indexes for what operators and retention read, so that `worker status`, the status page,
-- the metrics collector, `worker retry --failed` and purge each stay in milliseconds on a table of
-- millions of rows (issue 11: up to seconds each on 4.25M rows, by parallel sequential scans).
--
-- Every index here is partial on a state that a row enters at most once per attempt and never
-- from the claim: a row pays for the done or the failed indexes once, when it finishes (as it paid
-- for tasks_finished_idx, which they replace), and for the scheduled one only when it is delayed.
-- The due path (insert, claim, complete) gains no index.
--
-- The indexes are built after the file's transaction commits (below `-- worker:online`), without
-- stopping the workers' reads and writes of the table; the index they replace goes after them.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- The planner's estimate of one queue's rows in one state, which status shows where a count stopped
-- at its cap: what EXPLAIN says (from the joint statistics below, so per queue, and scaled to the
-- table's current size), readable by any role that may read the table, unlike pg_stats_ext.
-- Planning costs a fraction of a millisecond; nothing is executed.
CREATE STATISTICS {schema}.tasks_queue_state (mcv) ON queue, state FROM {schema}.tasks;

CREATE FUNCTION {schema}.estimated_rows(queue text, state text) RETURNS float8
LANGUAGE plpgsql AS $$
DECLARE
    plan json;
BEGIN
    EXECUTE format('EXPLAIN (FORMAT JSON) SELECT 1 FROM {schema}.tasks WHERE queue = %L AND state = %L',
                   queue, state)
       INTO plan;
    RETURN (plan -> 0 -> 'Plan' ->> 'Plan Rows')::float8;
END;
$$;

-- worker:online

-- Retention keeps done and cancelled rows for an hour and failed rows for a week. In one index
-- ordered by finished_at, the kept failures sat in front of the expired done rows, and every purge
-- round walked all of them (0.6-1.9 s a round at 1M failures). Apart, each purge reads only
-- entries it deletes (queries/tasks.sql, purge).
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_done_idx ON {schema}.tasks (finished_at)
    WHERE state IN ('done', 'cancelled');

-- Failures: oldest first for purge and `retry --failed`, newest first for the status views.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_failed_idx ON {schema}.tasks (finished_at, id)
    WHERE state = 'failed';

-- Failures of one queue, for `retry --failed --queue` and per-queue counts (index-only, bounded).
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_failed_queue_idx ON {schema}.tasks (queue, finished_at, id)
    WHERE state = 'failed';

-- Delayed rows of one queue: per-queue counts and "is anything due here" without reading the
-- rows. tasks_scheduled_idx (run_at) serves promotion, which reads every queue in run_at order.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_scheduled_queue_idx ON {schema}.tasks (queue, run_at)
    WHERE state = 'scheduled';

DROP INDEX CONCURRENTLY IF EXISTS {schema}.tasks_finished_idx;
