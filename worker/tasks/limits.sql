-- Flow control: the limits of queues (schema/0014).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: set_limit
-- Set a queue's limits (every one of them: a NULL removes that limit). source 'code' does not
-- override an operator's setting; false when nothing changed for that reason.
SELECT {schema}.set_queue_limit(
    queue => %(queue)s, concurrency => %(concurrency)s, key_concurrency => %(key_concurrency)s,
    rate => %(rate)s, rate_seconds => %(rate_seconds)s, key_rate => %(key_rate)s,
    key_rate_seconds => %(key_rate_seconds)s, source => %(source)s,
    updated_by => %(by)s, burst => %(burst)s, key_burst => %(key_burst)s) AS changed;

-- name: clear_limit
-- Remove a queue's limits; false when it had none.
SELECT {schema}.clear_queue_limit(queue => %(queue)s) AS changed;

-- name: limits
-- Every limited queue with what it holds now: `running` (rows running, leases not expired:
-- those that hold a place under a concurrency limit, or, in a queue limited by rates alone,
-- every running row of the queue, read through the running rows' index), `waiting` (queued and
-- due), the starts inside the queue's rate window (the current period's) and the keys among the
-- running. Counts stop at %(cap)s (a bounded read of the indexes whatever the backlog). At most
-- %(limit)s queues, by name.
SELECT l.queue, l.concurrency, l.key_concurrency, l.rate, l.rate_seconds, l.key_rate,
       l.key_rate_seconds, l.source, l.updated_by, l.updated_at,
       CASE WHEN l.concurrency IS NOT NULL OR l.key_concurrency IS NOT NULL THEN
           (SELECT count(*) FROM (
               SELECT 1 FROM {schema}.tasks AS t
                WHERE t.queue = l.queue AND t.state = 'in_progress' AND t.limit_held
                  AND t.lease_expires_at >= now()
                LIMIT %(cap)s) AS r)
       ELSE
           (SELECT count(*) FROM (
               SELECT 1 FROM {schema}.tasks AS t
                WHERE t.queue = l.queue AND t.state = 'in_progress'
                  AND t.lease_expires_at >= now()
                LIMIT %(cap)s) AS r)
       END AS running,
       (SELECT count(*) FROM (
           SELECT 1 FROM {schema}.tasks AS t
            WHERE t.queue = l.queue AND t.state = 'queued' AND t.run_at <= now()
            LIMIT %(cap)s) AS w) AS waiting,
       (SELECT coalesce(max(r.window_starts), 0) FROM {schema}.limit_rates AS r
         WHERE r.queue = l.queue AND r.limit_key = ''
           AND r.window_start > now() - make_interval(secs => coalesce(l.rate_seconds, 0)))
           AS recent_starts,
       (SELECT count(DISTINCT r.limit_key) FROM (
           SELECT t.limit_key FROM {schema}.tasks AS t
            WHERE t.queue = l.queue AND t.state = 'in_progress' AND t.limit_held
              AND t.limit_key IS NOT NULL AND t.lease_expires_at >= now()
            LIMIT %(cap)s) AS r) AS running_keys,
       l.burst, l.key_burst
  FROM {schema}.queue_limits AS l
 ORDER BY l.queue
 LIMIT %(limit)s;
