-- Rescue of rows whose worker died or whose lease lapsed, and retention of finished rows.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: worker_died
-- The supervisor saw one of its worker processes die: its rows go back at once instead of
-- waiting for their leases (or to failed when that was their last attempt, as in rescue), each
-- with an error that says how the process died and which tasks it was running. The attempt
-- counts, as every claimed attempt does: the supervisor cannot tell the task that crashed the
-- process from its neighbours, and a task that kills its process must still run out of attempts.
-- The error joins the history (see retry).
-- A row someone asked to cancel ends 'cancelled' (schema/0010).
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                        WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'queued' END,
           run_at = now(),
           finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL
                                   OR t.attempts >= t.max_attempts THEN now() END,
           (last_error, errors) = (
               SELECT e.error,
                      jsonb_path_query_array(
                          coalesce(t.errors, '[]') || jsonb_build_object(
                              'attempt', t.attempts, 'at', now(),
                              'error', left(e.error, %(history_chars)s), 'worker_id', t.worker_id),
                          '$[last - $keep + 1 to last]',
                          jsonb_build_object('keep', %(history)s::integer))
                 FROM (SELECT left(%(error)s || ' during attempt ' || t.attempts
                                   || '; tasks it was running: ' || d.running, 4000) AS error) AS e),
           lease_expires_at = NULL
      FROM (SELECT id, string_agg(id || ' (' || left(task, 100) || ')', ', ') OVER () AS running
              FROM {schema}.tasks
             WHERE worker_id = %(worker_id)s
               AND state = 'in_progress'
             LIMIT 1000) AS d
     WHERE t.id = d.id
       AND t.state = 'in_progress'
       AND t.worker_id = %(worker_id)s
    RETURNING t.id, t.queue, t.task, t.state::text AS state
), gone AS (
    -- Its row in the registry: stopped, nothing in flight (status and the gauges then stop
    -- counting it; a process that stopped cleanly said so itself).
    UPDATE {schema}.workers AS w SET stopped_at = now(), in_flight = 0
     WHERE w.id = %(worker_id)s AND w.stopped_at IS NULL
)
SELECT id, queue, task, state FROM acked;

-- name: first_expired
-- The lease that ran out first among the rows a rescue from %(since)s (NULL: no bound) would
-- take, or no row when there is none: the maintenance thread looks with this before it takes the
-- worker's counted transaction for a rescue, and starts the rescue at the lease found. The walk
-- over the lease index's dead entries (a long transaction elsewhere leaves them by the million)
-- is made here, holding nothing, and not in the rescue, during which the worker's own claims and
-- acknowledgements wait for the hooks (see Maintenance.rescue).
SELECT lease_expires_at
  FROM {schema}.tasks
 WHERE state = 'in_progress'
   AND lease_expires_at < now()
   AND lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
 ORDER BY lease_expires_at
 LIMIT 1;

-- name: rescue
-- Any worker runs this now and then; no leader is needed. Rows whose lease ran out (their worker
-- died, hung or lost its connection) become claimable again, or failed when out of attempts; the
-- attempt that died was counted when it was claimed. SKIP LOCKED keeps concurrent rescuers apart.
-- The error joins the history (see retry).
-- A row someone asked to cancel (schema/0010) is not put back: it ends 'cancelled'.
-- %(since)s (NULL: no bound) starts the walk a little before this worker's last complete pass:
-- rows whose lease ran out earlier were there to take then. Without it, each pass would walk
-- the dead entries that every finished task leaves in tasks_lease_idx, and those pile up by the
-- hundred thousand while a long transaction elsewhere holds vacuum back. A full pass now and
-- then (see Maintenance.rescue) takes what a pass skipped because its row was locked.
-- The workers whose rows these were are marked stopped in the registry when they have not beaten
-- since (see gone).
WITH expired AS (
    SELECT id, worker_id, lease_expires_at
      FROM {schema}.tasks
     WHERE state = 'in_progress'
       AND lease_expires_at < now()
       AND lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), acked AS (
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                    WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'queued' END,
       run_at = now(),
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL
                               OR t.attempts >= t.max_attempts THEN now() END,
       (last_error, errors) = (
           SELECT e.error,
                  jsonb_path_query_array(
                      coalesce(t.errors, '[]') || jsonb_build_object(
                          'attempt', t.attempts, 'at', now(),
                          'error', left(e.error, %(history_chars)s), 'worker_id', t.worker_id),
                      '$[last - $keep + 1 to last]',
                      jsonb_build_object('keep', %(history)s::integer))
             FROM (SELECT format('LeaseExpired: worker %%s stopped renewing its lease during '
                                 'attempt %%s (it died, hung or lost its connection)',
                                 t.worker_id, t.attempts) AS error) AS e),
       lease_expires_at = NULL
-- See claim: primary-key look-ups, never a scan of the table.
 WHERE t.id = ANY(ARRAY(SELECT id FROM expired))
RETURNING t.id, t.queue, t.task, t.state::text AS state
), gone AS (
    -- A worker whose heartbeat (which renews every lease it holds) has not come since the first
    -- of these leases ran out is dead, hung or cut off: its row in the registry says it stopped
    -- at its last heartbeat, with nothing in flight, so that status and the gauges stop counting
    -- it and its stale in-flight count. stopped_at = heartbeat_at is this mark: a worker that was
    -- only cut off clears it with its next heartbeat (see heartbeat in acks.sql).
    UPDATE {schema}.workers AS w SET stopped_at = w.heartbeat_at, in_flight = 0
      FROM (SELECT e.worker_id, min(e.lease_expires_at) AS lapsed
              FROM expired AS e
             WHERE e.worker_id IS NOT NULL
             GROUP BY e.worker_id) AS e
     WHERE w.id = e.worker_id
       AND w.stopped_at IS NULL
       AND w.heartbeat_at < e.lapsed
)
SELECT id, queue, task, state FROM acked;

-- name: purge
-- Retention: delete finished rows past their retention in small batches, oldest first. Done and
-- cancelled rows (kept `done_seconds`) and failed ones (kept `failed_seconds` too, usually much
-- longer) are read from two indexes (schema/0007), so a round reads only the entries it deletes
-- and never walks the failures it keeps. Done rows go first; failed ones fill what is left of the
-- batch. Cron rows are kept at least `cron_keep_seconds` so that a late, clock-skewed node cannot
-- enqueue the same slot again.
-- Workflow steps (schema/0022): a step whose dependents are not settled yet stays until the
-- maintenance sweep has settled them; a step that goes takes its own edges (what it waited for:
-- its dependents' edges hold the outcome and result they need), and a workflow whose last step
-- goes goes with it. Plain rows (no workflow_id) make both look-ups empty.
WITH gone AS (
    DELETE FROM {schema}.tasks
     WHERE id = ANY(ARRAY(
        SELECT id FROM (
            SELECT id FROM (
                SELECT id
                  FROM {schema}.tasks
                 WHERE state IN ('done', 'cancelled')
                   AND finished_at < now() - make_interval(secs => %(done_seconds)s)
                   AND (cron_key IS NULL
                        OR finished_at < now() - make_interval(secs => %(cron_keep_seconds)s))
                   AND dependents IS NOT TRUE
                 ORDER BY finished_at
                 LIMIT %(limit)s
                   FOR UPDATE SKIP LOCKED) AS done
            UNION ALL
            SELECT id FROM (
                SELECT id
                  FROM {schema}.tasks
                 WHERE state = 'failed'
                   AND finished_at < now() - make_interval(secs => %(failed_seconds)s)
                   AND finished_at < now() - make_interval(secs => %(done_seconds)s)
                   AND (cron_key IS NULL
                        OR finished_at < now() - make_interval(secs => %(cron_keep_seconds)s))
                   AND dependents IS NOT TRUE
                 ORDER BY finished_at
                 LIMIT %(limit)s
                   FOR UPDATE SKIP LOCKED) AS failed
            LIMIT %(limit)s) AS expired
     ))
    RETURNING id, workflow_id
), steps AS (
    SELECT count(*) AS n,
           coalesce(array_agg(g.id) FILTER (WHERE g.workflow_id IS NOT NULL), '{}') AS ids,
           coalesce(array_agg(DISTINCT g.workflow_id) FILTER (WHERE g.workflow_id IS NOT NULL),
                    '{}') AS flows
      FROM gone AS g
), edges AS (
    DELETE FROM {schema}.task_deps AS d
     WHERE d.task_id = ANY((SELECT s.ids FROM steps AS s)::bigint[])
), flows AS (
    -- The statement sees the tasks as they were before it: a workflow is empty when every step
    -- it still sees is among those deleted now.
    DELETE FROM {schema}.workflows AS w
     WHERE w.id = ANY((SELECT s.flows FROM steps AS s)::bigint[])
       AND NOT EXISTS (SELECT 1 FROM {schema}.tasks AS t
                        WHERE t.workflow_id = w.id
                          AND t.id <> ALL((SELECT s.ids FROM steps AS s)::bigint[]))
)
SELECT s.n FROM steps AS s;

-- name: rotate_history
-- Retention of the history (schema/0025): empty the slots whose rows are all older than
-- %(done_seconds)s, and open the next slot once the current one is a slice old. Any worker runs
-- it; concurrent calls return at once.
SELECT {schema}.rotate_history(%(done_seconds)s::float8) AS emptied;

-- name: settle_missed
-- Workflows (schema/0022): steps that finished without an acknowledgement that settled their
-- dependents (a rescue or a supervisor's hand-back that failed them for good, an SQL update), and
-- waiting steps with nothing left to wait for, at most %(limit)s of each. Two probes of partial
-- indexes that are empty unless workflows need it; SKIP LOCKED, no leader.
SELECT {schema}.settle_missed(%(limit)s) AS settled;
