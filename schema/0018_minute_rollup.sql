-- 0018: a rollup of the queue, one row a minute, for the charts of the console and the status
-- page: how many tasks waited and ran, and how long the tasks that finished waited to start.
--
-- The depth of a queue in the past cannot be read back from the task table (the rows have moved
-- on, and retention deletes finished ones), and the wait times of a busy hour are millions of
-- rows: the workers' maintenance writes these rows as it goes (one worker per minute, whichever
-- comes first), and every server that shows a chart reads the same rows. Neither table is on the
-- path of a task: the task table gains no column and no index here.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- One row per minute recorded, written first: the worker that inserts it records the minute,
-- the others find it there and do nothing. The fleet's totals at `sampled_at` (a little after
-- the minute ended): tasks due and waiting (`queued`, counted up to a cap: `queued_capped` when it
-- reached it) and running.
CREATE TABLE {schema}.stats_minutes (
    minute        timestamptz PRIMARY KEY,
    sampled_at    timestamptz NOT NULL DEFAULT now(),
    queued        bigint      NOT NULL DEFAULT 0,
    queued_capped boolean     NOT NULL DEFAULT false,
    in_progress   bigint      NOT NULL DEFAULT 0
);

-- The same minute per queue: tasks due and waiting (up to a cap) and running at `sampled_at`,
-- and of the tasks that finished during the minute (done, or failed for good) and whose wait
-- was measured (`waited`, at most a sample's worth), the median and the 99th percentile of the
-- seconds from due (run_at) to start (started_at) of their last attempt.
CREATE TABLE {schema}.queue_minutes (
    minute      timestamptz NOT NULL,
    queue       text        NOT NULL,
    queued      bigint      NOT NULL DEFAULT 0,
    in_progress bigint      NOT NULL DEFAULT 0,
    waited      integer     NOT NULL DEFAULT 0,
    wait_p50    float8,
    wait_p99    float8,
    PRIMARY KEY (minute, queue)
);
