-- The charts' reads of the minute rollup the workers write (schema/0018, engine/rollup.sql).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: trend_window
-- The charts' window by the database's clock: its first minute (%(minutes)s minutes back,
-- counting the current one) and its end (the end of the current minute).
SELECT date_trunc('minute', now()) - make_interval(mins => %(minutes)s - 1) AS start,
       date_trunc('minute', now()) + interval '1 minute' AS "end";

-- name: trend_depth
-- The fleet's totals sampled since %(start)s: a minute's sample is taken a little after it ends,
-- so the minute before the window is read too (its sample falls inside it).
SELECT s.sampled_at, s.queued, s.queued_capped, s.in_progress
  FROM {schema}.stats_minutes AS s
 WHERE s.minute >= %(start)s::timestamptz - interval '1 minute'
   AND s.sampled_at >= %(start)s::timestamptz
 ORDER BY s.minute;

-- name: trend_waits
-- The wait times, minute by minute since %(start)s, of the %(queues)s queues with the most tasks
-- measured in that time (the busiest first).
WITH top AS (
    SELECT q.queue, row_number() OVER (ORDER BY sum(q.waited) DESC, q.queue) AS rank
      FROM {schema}.queue_minutes AS q
     WHERE q.minute >= %(start)s::timestamptz AND q.waited > 0
     GROUP BY q.queue
     ORDER BY sum(q.waited) DESC, q.queue
     LIMIT %(queues)s
)
SELECT q.queue, q.minute, q.waited, q.wait_p50, q.wait_p99
  FROM {schema}.queue_minutes AS q
  JOIN top ON top.queue = q.queue
 WHERE q.minute >= %(start)s::timestamptz AND q.waited > 0
 ORDER BY top.rank, q.minute;
