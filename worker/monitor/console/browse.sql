-- The console's job browser, one task, and throughput.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.
-- A value larger than %(stored)s bytes as stored (pg_column_size, read without loading it) is
-- never turned into text for a page: that would load and convert all of it for a few lines.
-- left() of a text column reads only the start of it; octet_length() only its header.

-- name: browse_any
-- Every task, newest id first, in the task table and the history (task_rows, schema/0025); or
-- the waiting steps of workflows (%(state)s), which no index holds: found among the rows of the
-- same walk.
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(queue)s::text IS NULL OR s.queue = %(queue)s)
           AND (%(state)s::text IS NULL OR s.state::text = %(state)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM (SELECT t.* FROM {schema}.task_rows AS t
             WHERE t.id < %(after_id)s
             ORDER BY t.id DESC
             LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_running
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(queue)s::text IS NULL OR s.queue = %(queue)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM (SELECT t.* FROM {schema}.tasks AS t
             WHERE t.state = 'in_progress' AND t.id < %(after_id)s
             ORDER BY t.id DESC
             LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_queued
-- Claim order, queue by queue: the order in which workers will take them.
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM (SELECT t.* FROM {schema}.tasks AS t
             WHERE t.state = 'queued'
               AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
               AND (t.queue, (-t.priority), t.run_at, t.id)
                   > (%(after_queue)s::text, %(after_priority)s::int, %(after_at)s::timestamptz,
                      %(after_id)s::bigint)
             ORDER BY t.queue, (-t.priority), t.run_at, t.id
             LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_scheduled
-- Next due first.
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM (SELECT t.* FROM {schema}.tasks AS t
             WHERE t.state = 'scheduled'
               AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
               AND (t.run_at, t.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
             ORDER BY t.run_at, t.id
             LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_finished
-- Done or cancelled (%(state)s), newest finished first, from tasks_done_idx (which holds both)
-- and the history's slots (task_history_finished_idx, schema/0025), merged.
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           s.state::text = %(state)s
           AND (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(queue)s::text IS NULL OR s.queue = %(queue)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM ((SELECT t.* FROM {schema}.tasks AS t
              WHERE t.state IN ('done', 'cancelled') AND t.finished_at IS NULL
                AND %(in_nulls)s AND t.id < %(after_id)s
              ORDER BY t.id + 0 DESC
              LIMIT %(scan)s)
            UNION ALL
            (SELECT t.* FROM {schema}.task_rows AS t
              WHERE t.state IN ('done', 'cancelled')
                AND (t.finished_at, t.id)
                    < (%(after_at)s::timestamptz, %(after_finished_id)s::bigint)
              ORDER BY t.finished_at DESC, t.id DESC
              LIMIT %(scan)s)
            LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_failed
-- Newest failure first, from tasks_failed_idx, or tasks_failed_queue_idx for one queue.
SELECT w.id, left(w.queue, 255) AS queue, char_length(w.queue) AS queue_length,
       left(w.task, 255) AS task, char_length(w.task) AS task_length, w.state::text AS state,
       w.priority, w.attempts, w.max_attempts,
       w.run_at, w.created_at, w.started_at, w.finished_at,
       left(w.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(w.last_error) <= %(stored)s
            THEN char_length(w.last_error) ELSE octet_length(w.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(w.payload) <= %(stored)s
            THEN left(w.payload::text, %(chars)s) END AS payload, w.hit, w.n
  FROM (
    SELECT s.*,
           (%(task)s::text IS NULL OR s.task = %(task)s)
           AND (%(pattern)s::text IS NULL OR s.payload::text ILIKE %(pattern)s
                OR s.last_error ILIKE %(pattern)s) AS hit,
           row_number() OVER () AS n
      FROM ((SELECT t.* FROM {schema}.tasks AS t
              WHERE t.state = 'failed' AND t.finished_at IS NULL
                AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
                AND %(in_nulls)s AND t.id < %(after_id)s
              ORDER BY t.id + 0 DESC
              LIMIT %(scan)s)
            UNION ALL
            (SELECT t.* FROM {schema}.tasks AS t
              WHERE t.state = 'failed'
                AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
                AND (t.finished_at, t.id)
                    < (%(after_at)s::timestamptz, %(after_finished_id)s::bigint)
              ORDER BY t.finished_at DESC, t.id DESC
              LIMIT %(scan)s)
            LIMIT %(scan)s) AS s
  ) AS w
 WHERE w.hit OR w.n = %(scan)s
 LIMIT %(limit)s;

-- name: browse_id
-- One task by id, if it matches the rest of the filter, from the task table or the history
-- (task_rows, schema/0025).
SELECT t.id, left(t.queue, 255) AS queue, char_length(t.queue) AS queue_length,
       left(t.task, 255) AS task, char_length(t.task) AS task_length, t.state::text AS state,
       t.priority, t.attempts, t.max_attempts,
       t.run_at, t.created_at, t.started_at, t.finished_at,
       left(t.last_error, %(chars)s) AS last_error, CASE WHEN pg_column_size(t.last_error) <= %(stored)s
            THEN char_length(t.last_error) ELSE octet_length(t.last_error) END
         AS last_error_length,
       CASE WHEN pg_column_size(t.payload) <= %(stored)s
            THEN left(t.payload::text, %(chars)s) END AS payload, true AS hit, 1::bigint AS n
  FROM {schema}.task_rows AS t
 WHERE t.id = %(id)s
   AND (%(state)s::text IS NULL OR t.state::text = %(state)s)
   AND (%(task)s::text IS NULL OR t.task = %(task)s)
   AND (%(queue)s::text IS NULL OR t.queue = %(queue)s)
   AND (%(pattern)s::text IS NULL OR t.payload::text ILIKE %(pattern)s
        OR t.last_error ILIKE %(pattern)s);

-- name: throughput_minutes
-- Tasks finished per minute, for each minute starting at one of %(minutes)s: done ones from
-- tasks_done_idx and the history's slots (schema/0025), failed ones (failed for good: retries are not counted) from tasks_failed_idx,
-- each counted up to %(cap)s. Counted from the rows retention keeps: a minute older than
-- --keep-done (or --keep-failed) has lost its rows, and with --keep-done 0 there are none.
SELECT m.minute,
       (SELECT count(*)
          FROM (SELECT 1 FROM {schema}.task_rows AS t
                 WHERE t.state IN ('done', 'cancelled')
                   AND t.finished_at >= m.minute AND t.finished_at < m.minute + interval '1 minute'
                   AND t.state = 'done'
                 LIMIT %(cap)s) AS c) AS done,
       (SELECT count(*)
          FROM (SELECT 1 FROM {schema}.tasks AS t
                 WHERE t.state = 'failed'
                   AND t.finished_at >= m.minute AND t.finished_at < m.minute + interval '1 minute'
                 LIMIT %(cap)s) AS c) AS failed
  FROM unnest(%(minutes)s::timestamptz[]) AS m(minute)
 ORDER BY m.minute;

-- name: console_minute
-- The database's clock, cut to the minute: the throughput's minutes are the database's, so every
-- machine that serves the console counts the same ones.
SELECT date_trunc('minute', now()) AS minute;

-- name: console_task
-- One task for its page: names and keys cut to %(name_chars)s characters; the last error cut to
-- %(chars)s characters; the payload, the result and the error history as text cut to %(chars)s
-- characters (pretty when small) with their sizes as JSON, or, stored larger than %(stored)s
-- bytes, only their stored sizes; the worker that holds or last held it, and its lease; the
-- workflow it is a step of (schema/0022), if any. From the task table or the history
-- (task_rows, schema/0025), as every read of one task by id.
SELECT t.id, left(t.queue, %(name_chars)s) AS queue, char_length(t.queue) AS queue_length,
       left(t.task, %(name_chars)s) AS task, char_length(t.task) AS task_length,
       t.state::text AS state, t.priority, t.attempts, t.max_attempts, t.handed_back,
       t.run_at, t.created_at, t.started_at, t.finished_at, t.lease_expires_at,
       extract(epoch FROM t.lease_expires_at - now())::float8 AS lease_seconds_left,
       extract(epoch FROM coalesce(t.started_at, now()) - t.created_at)::float8 AS waited_seconds,
       extract(epoch FROM coalesce(t.finished_at, now()) - t.started_at)::float8 AS ran_seconds,
       left(t.dedupe_key, %(name_chars)s) AS dedupe_key,
       left(t.cron_key, %(name_chars)s) AS cron_key,
       t.cron_at, t.cancel_requested_at, left(t.cancelled_by, %(name_chars)s) AS cancelled_by,
       t.workflow_id, t.pending_deps, t.worker_id, w.host AS worker_host, w.pid AS worker_pid,
       w.heartbeat_at AS worker_heartbeat_at, w.stopped_at AS worker_stopped_at,
       left(t.last_error, %(chars)s) AS last_error, octet_length(t.last_error) AS last_error_bytes,
       CASE WHEN pg_column_size(t.last_error) <= %(stored)s THEN char_length(t.last_error) END
         AS last_error_length,
       left(CASE WHEN octet_length(j.payload) <= %(pretty)s THEN jsonb_pretty(t.payload)
                 ELSE j.payload END, %(chars)s) AS payload,
       octet_length(j.payload) AS payload_bytes, pg_column_size(t.payload) AS payload_stored,
       left(CASE WHEN octet_length(j.result) <= %(pretty)s THEN jsonb_pretty(t.result)
                 ELSE j.result END, %(chars)s) AS result,
       octet_length(j.result) AS result_bytes, pg_column_size(t.result) AS result_stored,
       octet_length(j.errors) AS errors_bytes, pg_column_size(t.errors) AS errors_stored,
       -- The error history (schema/0008), newest first: the last ten entries, each error cut to
       -- 4,000 characters. Anything a producer could have written there by SQL (not an array,
       -- entries that are not objects, a million of them) reads as what it holds, bounded.
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                    'attempt', e.value->'attempt', 'at', e.value->'at',
                    'worker_id', e.value->'worker_id',
                    'error', left(e.value->>'error', 4000)) ORDER BY e.n DESC), '[]')
          FROM (SELECT x.value, x.n
                  FROM jsonb_array_elements(CASE WHEN j.errors IS NULL THEN '[]'
                                                 WHEN jsonb_typeof(t.errors) = 'array'
                                                 THEN t.errors ELSE '[]' END)
                       WITH ORDINALITY AS x(value, n)
                 ORDER BY x.n DESC
                 LIMIT 10) AS e)
           AS errors
  FROM {schema}.task_rows AS t
 -- Each value as text once (OFFSET 0 keeps it from being computed again for each use), and only
 -- when it is small enough as stored.
 CROSS JOIN LATERAL (
       SELECT CASE WHEN pg_column_size(t.payload) <= %(stored)s THEN t.payload::text END AS payload,
              CASE WHEN pg_column_size(t.result) <= %(stored)s THEN t.result::text END AS result,
              CASE WHEN pg_column_size(t.errors) <= %(stored)s THEN t.errors::text END AS errors
       OFFSET 0) AS j
  LEFT JOIN {schema}.workers AS w ON w.id = t.worker_id
 WHERE t.id = %(id)s;

-- name: console_download_exists
-- Whether the task has the value (payload, result or errors) a download asks for.
SELECT CASE %(what)s WHEN 'payload' THEN t.payload IS NOT NULL
                     WHEN 'result' THEN t.result IS NOT NULL
                     ELSE t.errors IS NOT NULL END
  FROM {schema}.task_rows AS t
 WHERE t.id = %(id)s;

-- name: console_download
-- The value as JSON text in UTF-8, in chunks of %(chunk)s bytes, first to last: converted once
-- (OFFSET 0), then cut without copying the rest.
SELECT g AS n, substring(d.data FROM g * %(chunk)s + 1 FOR %(chunk)s) AS chunk
  FROM (SELECT convert_to(CASE %(what)s WHEN 'payload' THEN t.payload::text
                                        WHEN 'result' THEN t.result::text
                                        ELSE t.errors::text END, 'UTF8') AS data
          FROM {schema}.task_rows AS t
         WHERE t.id = %(id)s
        OFFSET 0) AS d
 CROSS JOIN LATERAL generate_series(0, (octet_length(d.data) - 1) / %(chunk)s) AS g;
