-- Acknowledgements of a worker's finished tasks, fenced on (worker id, attempt), and lease renewal.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: complete_with_result
-- `complete` (store/claims.sql) for the rows whose handler returned a result to store, and for
-- workflow steps that others wait for (whatever they returned): the same fencing, word for
-- word, plus the result. Whoever runs it for a step settles the step in the same transaction.
-- Run in the same acknowledging transaction as `complete`, and only when the batch holds such
-- rows, so that tasks which store nothing keep the acknowledgement they had. Results arrive as JSON text, checked by the worker (see
-- tasks.results.encode_result), and are cast here. A row someone asked to cancel ends 'cancelled'
-- and keeps no result, as in `complete`.
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'done'::{schema}.task_state
                        ELSE 'cancelled' END,
           finished_at = now(), lease_expires_at = NULL,
           result = CASE WHEN t.cancel_requested_at IS NULL
                         THEN ((%(results)s::text[])[array_position(%(ids)s::bigint[], t.id)])::jsonb
                    END,
           -- A workflow step others wait for is settled in this transaction (settle_steps,
           -- right after): marked so here, in this row version, not in another one.
           dependents = CASE WHEN t.dependents THEN false ELSE t.dependents END
     WHERE t.id = ANY(%(ids)s::bigint[])  -- the batch's rows by primary key (see complete)
       AND t.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], t.id)]
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state
)
SELECT id, state FROM acked;

-- name: complete_steps
-- `complete_with_result` for workflow steps that others wait for, settling their dependents in
-- the same statement (schema/0028): what the acknowledgement wrote (each step's outcome, result
-- and task) goes onto the steps' edges (step_edges), and from there onto their dependents, under
-- their row locks (settle_released), releasing those with nothing left to wait for. The same
-- fencing as `complete`, word for word. Each acknowledged row comes back with its new state,
-- next to how many dependents were released and in which queues (the same on every row). The
-- queues named `quiet` are not woken: the caller claims in them next (see settle_steps).
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'done'::{schema}.task_state
                        ELSE 'cancelled' END,
           finished_at = now(), lease_expires_at = NULL,
           result = CASE WHEN t.cancel_requested_at IS NULL
                         THEN ((%(results)s::text[])[array_position(%(ids)s::bigint[], t.id)])::jsonb
                    END,
           dependents = false  -- settled below, in this statement
     WHERE t.id = ANY(%(ids)s::bigint[])  -- the batch's rows by primary key (see complete)
       AND t.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], t.id)]
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state, t.result, t.task
), edges AS MATERIALIZED (
    SELECT e.*
      FROM (SELECT array_agg(a.id) AS ids, array_agg(a.state) AS states,
                   array_agg(a.result) AS results, array_agg(a.task) AS tasks
              FROM acked AS a) AS b,
           LATERAL {schema}.step_edges(b.ids, b.states, b.results, b.tasks) AS e
), settled AS MATERIALIZED (
    SELECT s.*
      FROM edges AS e,
           LATERAL {schema}.settle_released(e.kids, e.counts, e.blockers, e.errors,
                                            %(quiet)s::text[]) AS s
)
SELECT a.id, a.state, s.released, s.ready_queues FROM acked AS a, settled AS s;

-- name: notify_done
-- Wake whoever waits on these tasks (comma-separated ids, under 8,000 bytes: the caller splits
-- longer lists). Sent inside the transaction that finished them, so it arrives only once their
-- new state is visible, and never if that transaction rolls back.
SELECT pg_notify(%(channel)s, %(ids)s);

-- name: complete
-- Mark finished tasks done in one statement per batch. Fencing: only the owner's current attempt
-- of a row still in progress may complete it; a worker that lost its lease gets nothing back for
-- that row and learns it lost the row. A row someone asked to cancel (schema/0010) ends
-- 'cancelled', not 'done', whatever its handler returned: the request and this statement lock
-- the row in turn, so a request that was granted is never followed by 'done'.
-- "In progress" is spelled "lease_expires_at IS NOT NULL" in the fencing statements (the two are
-- the same by the tasks_lease_iff_running constraint). Written as state = 'in_progress', the
-- planner may scan the whole partial lease index, dead entries and all, instead of fetching the
-- batch by primary key; that made acknowledgements the slowest step of the worker.
-- The batch's rows are fetched by `t.id = ANY(ids)` on the primary key, the only condition an
-- index can serve, and each row's attempt is read from the batch by its position there: the
-- statement joins nothing, so every plan PostgreSQL may choose for it, the generic one it caches
-- included, reads the batch's rows and no others, whatever the table held when the plan was
-- made. It is prepared (planned once per connection, not once per batch: parsing and planning
-- were a third of a one-row acknowledgement). Written as a join of the table with unnest(ids,
-- attempts), a generic plan cached while the table was small read the whole primary key for
-- each acknowledgement once it was large. Finding a position costs a pass over the batch, so a
-- batch is acknowledged in pieces of at most ACK_PIECE rows (store/acks.py): at 100 rows the
-- two forms cost the same, at 300 the passes cost more than the plan. (complete_steps takes its
-- batch whole: see complete_steps in store/acks.py.) The position found is the id's first, so
-- no batch given to these statements holds a task twice: one outcome of a cancelled attempt and
-- one of the same task claimed again by the same worker go in different pieces (store/acks.py),
-- or the stale attempt's position would fence out the current one.
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'done'::{schema}.task_state
                        ELSE 'cancelled' END,
           finished_at = now(), lease_expires_at = NULL
     WHERE t.id = ANY(%(ids)s::bigint[])  -- the batch's rows by primary key (see above)
       AND t.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], t.id)]
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state
)
SELECT id, state FROM acked;

-- name: complete_delete
-- The same fencing as `complete`, for installations that keep no finished rows (retention 0):
-- deleting is cheaper than writing a new row version that retention would delete later. Cron rows
-- and rows with a cancel request are left to `complete` (a cron slot must stay taken; a
-- cancelled task stays visible as cancelled until retention removes it), and so are workflow steps
-- that others wait for (settle_steps reads their outcome and result from the row).
WITH acked AS (
    DELETE FROM {schema}.tasks AS t
     WHERE t.id = ANY(%(ids)s::bigint[])  -- the batch's rows by primary key (see complete)
       AND t.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], t.id)]
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
       AND t.cron_key IS NULL
       AND t.cancel_requested_at IS NULL
       AND t.dependents IS NOT TRUE
    RETURNING t.id
)
SELECT id FROM acked;

-- name: complete_move
-- The same fencing as `complete`, for a worker that keeps finished rows in the history
-- (schema/0025): a plain task that ends 'done' leaves the claim table in this statement, deleted
-- from `tasks` and written to the history's current slot, where retention empties whole slots
-- instead of deleting rows. A row is in exactly one of the two tables in any snapshot, and
-- `task_rows` reads both. Left to `complete` (or `complete_with_result`), as in
-- `complete_delete`: cron rows (their slot must stay taken), rows with a cancel request (they end
-- 'cancelled') and workflow steps (their edges and their workflow go with them at retention;
-- settle_steps reads the ones others wait for). A statement that waits for one of these rows'
-- locks while it moves (a rescue, a cancel, a heartbeat) finds it deleted and passes over it, as
-- with `complete_delete`. %(results)s: each row's result to store, as complete_with_result has
-- them; NULL for rows whose handler stored none (the row keeps its own, as `complete` does).
WITH gone AS (
    DELETE FROM {schema}.tasks AS t
     WHERE t.id = ANY(%(ids)s::bigint[])  -- the batch's rows by primary key (see complete)
       AND t.attempts = (%(attempts)s::integer[])[array_position(%(ids)s::bigint[], t.id)]
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
       AND t.cron_key IS NULL
       AND t.cancel_requested_at IS NULL
       AND t.workflow_id IS NULL
       AND t.dependents IS NOT TRUE
    RETURNING t.*, (%(results)s::text[])[array_position(%(ids)s::bigint[], t.id)] AS stored
), moved AS (
    INSERT INTO {schema}.task_history (id, queue, task, payload, priority, run_at, attempts, max_attempts,
                                       last_error, dedupe_key, cron_key, cron_at, worker_id,
                                       created_at, started_at, handed_back, errors,
                                       cancel_requested_at, cancelled_by, result, trace_context,
                                       limit_key, limit_held, workflow_id, pending_deps,
                                       dependents, inputs, state, finished_at, slot)
    SELECT g.id, g.queue, g.task, g.payload, g.priority, g.run_at, g.attempts, g.max_attempts,
           g.last_error, g.dedupe_key, g.cron_key, g.cron_at, g.worker_id, g.created_at,
           g.started_at, g.handed_back, g.errors, g.cancel_requested_at, g.cancelled_by,
           coalesce(g.stored::jsonb, g.result), g.trace_context, g.limit_key, g.limit_held,
           g.workflow_id, g.pending_deps, g.dependents, g.inputs, 'done', now(),
           (SELECT h.slot FROM {schema}.history_slots AS h WHERE h.state = 'current')
      FROM gone AS g
    RETURNING id
)
SELECT id FROM moved;

-- name: retry
-- Failed attempts: back to queued after the backoff delay, or failed when the handler said not to
-- retry or the row has used its attempts (its own max_attempts, which an operator may have raised).
-- Each error is also appended to the row's history (`errors`, schema/0008): the last
-- %(history)s attempts, each error cut to %(history_chars)s characters, stamped with the database
-- clock and the worker. Only this statement and the other three that record an error (hand_back,
-- worker_died, rescue) pay for it; claim and complete do not touch the column.
-- A row someone asked to cancel ends 'cancelled' instead: it is never retried.
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                        WHEN a.permanent OR t.attempts >= coalesce(t.max_attempts, nullif(a.max_attempts, 0))
                        THEN 'failed'
                        WHEN a.delay > 0 THEN 'scheduled' ELSE 'queued' END,
           run_at = CASE WHEN t.cancel_requested_at IS NOT NULL OR a.permanent
                              OR t.attempts >= coalesce(t.max_attempts, nullif(a.max_attempts, 0))
                         THEN t.run_at ELSE now() + make_interval(secs => a.delay) END,
           finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL OR a.permanent
                                   OR t.attempts >= coalesce(t.max_attempts, nullif(a.max_attempts, 0))
                              THEN now() END,
           max_attempts = coalesce(t.max_attempts, nullif(a.max_attempts, 0)),
           last_error = a.error,
           errors = jsonb_path_query_array(
               coalesce(t.errors, '[]') || jsonb_build_object(
                   'attempt', t.attempts, 'at', now(), 'error', left(a.error, %(history_chars)s),
                   'worker_id', t.worker_id),
               '$[last - $keep + 1 to last]', jsonb_build_object('keep', %(history)s::integer)),
           lease_expires_at = NULL
      FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(delays)s::float8[],
                  %(errors)s::text[], %(permanent)s::boolean[], %(max_attempts)s::integer[])
           AS a(id, attempt, delay, error, permanent, max_attempts)
     WHERE t.id = a.id
       AND t.id = ANY(%(ids)s::bigint[])  -- by primary key in every plan (see heartbeat)
       AND t.attempts = a.attempt
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state
)
SELECT id, state FROM acked;

-- name: hand_back
-- Rows this worker has no handler for (an old worker during a rolling deploy, a typo in a task
-- name): back to 'scheduled' without counting the attempt, later each time (5 s, 10 s, 20 s, ...
-- up to 10 minutes), with an error that says why. A worker that has the handler takes them at
-- once when it starts (workers.sql, register). The error joins the history (see retry) marked
-- "counted": false, under the number of the attempt that was not counted. One with a cancel
-- request ends 'cancelled'.
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'scheduled'::{schema}.task_state
                        ELSE 'cancelled' END,
           attempts = greatest(t.attempts - 1, 0),
           run_at = CASE WHEN t.cancel_requested_at IS NULL
                         THEN now() + make_interval(
                             secs => least(5 * power(2, least(t.handed_back, 10)), 600))
                         ELSE t.run_at END,
           handed_back = t.handed_back + 1, last_error = left(a.error, 4000),
           errors = jsonb_path_query_array(
               coalesce(t.errors, '[]') || jsonb_build_object(
                   'attempt', t.attempts, 'at', now(), 'error', left(a.error, %(history_chars)s),
                   'worker_id', t.worker_id, 'counted', false),
               '$[last - $keep + 1 to last]', jsonb_build_object('keep', %(history)s::integer)),
           finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL THEN now() END,
           started_at = NULL, lease_expires_at = NULL
      FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(errors)s::text[])
           AS a(id, attempt, error)
     WHERE t.id = a.id
       AND t.id = ANY(%(ids)s::bigint[])  -- by primary key in every plan (see heartbeat)
       AND t.attempts = a.attempt
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state
)
SELECT id, state FROM acked;

-- name: release
-- Graceful stop: hand back tasks that did not start, or whose handlers stopped at the stop's
-- request, or (when the process exits with the stop) that did not finish within the grace
-- period. The interrupted
-- attempt is not counted, so a deploy does not use up a task's retries. A row with a cancel
-- request is not handed back: it ends 'cancelled' (its attempt counted, as it ran).
WITH acked AS (
    UPDATE {schema}.tasks AS t
       SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'queued'::{schema}.task_state
                        ELSE 'cancelled' END,
           attempts = CASE WHEN t.cancel_requested_at IS NULL THEN greatest(t.attempts - 1, 0)
                           ELSE t.attempts END,
           run_at = CASE WHEN t.cancel_requested_at IS NULL THEN now() ELSE t.run_at END,
           started_at = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.started_at END,
           finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL THEN now() END,
           lease_expires_at = NULL
      FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
     WHERE t.id = a.id
       AND t.id = ANY(%(ids)s::bigint[])  -- by primary key in every plan (see heartbeat)
       AND t.attempts = a.attempt
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
    RETURNING t.id, t.state::text AS state
)
SELECT id, state FROM acked;

-- name: heartbeat
-- One statement per heartbeat, whatever the number of tasks in flight: renew the leases of this
-- worker's rows at the attempts it claimed, and its own row. It returns the ids that are lost
-- (rescued, claimed again, or at another attempt): the worker must not complete them; and, with
-- `cancel` true, those it renewed that someone asked to cancel (schema/0010), in case their
-- notification did not reach the worker.
-- SKIP LOCKED: a row locked right now is being changed by our own acknowledgement or by a
-- transactional handler's commit (or by a rescuer, which the next heartbeat will notice); the
-- heartbeat never waits for it, and counts it as ours while it still is, or is done by us.
-- A rescue that found this worker silent marked its row stopped at its last heartbeat
-- (stopped_at = heartbeat_at, see rescue in recovery.sql): a heartbeat means it lives, and clears
-- that mark. A stop of its own (unregister) is never equal to a heartbeat and stays.
-- Every read of the tasks names its rows with `id = ANY(ids)`, which the primary key answers
-- directly: joined by `t.id = a.id` alone, a plan made while the table's statistics said it was
-- nearly empty (autovacuum off, or before its first analyse) read the whole primary key index
-- for each heartbeat, and under a long transaction elsewhere that took past the statement
-- timeout: leases were not renewed.
WITH me AS (
    UPDATE {schema}.workers
       SET heartbeat_at = now(), in_flight = cardinality(%(ids)s::bigint[]),
           stopped_at = CASE WHEN stopped_at = heartbeat_at THEN NULL ELSE stopped_at END
     WHERE id = %(worker_id)s
), mine AS (
    SELECT t.id
      FROM {schema}.tasks AS t
      JOIN unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt) ON t.id = a.id
     WHERE t.id = ANY(%(ids)s::bigint[])  -- by primary key in every plan (see below)
       AND t.attempts = a.attempt
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
       FOR UPDATE OF t SKIP LOCKED
), renewed AS (
    UPDATE {schema}.tasks AS t
       SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
     WHERE t.id = ANY(ARRAY(SELECT id FROM mine))
    RETURNING t.id, t.attempts, t.cancel_requested_at IS NOT NULL AS cancel
)
SELECT a.id, a.attempt, false AS cancel
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
  -- A row this worker just completed may have moved to the history (schema/0025): done by us.
  LEFT JOIN {schema}.task_rows AS t ON t.id = a.id AND t.id = ANY(%(ids)s::bigint[])
 WHERE a.id NOT IN (SELECT id FROM renewed)
   AND NOT coalesce(t.worker_id = %(worker_id)s AND t.attempts = a.attempt
                    AND (t.lease_expires_at IS NOT NULL OR t.state = 'done'), false)
UNION ALL
SELECT r.id, r.attempts, true AS cancel
  FROM renewed AS r
 WHERE r.cancel;

-- name: settle_steps
-- Workflows (schema/0022): the steps of this batch that others wait for, once acknowledged above
-- in the same transaction. Their outcome (and result) goes on their edges, each dependent's count
-- of unfinished dependencies drops by the number settled now, and a dependent whose count
-- reaches 0 becomes runnable (its workers are woken at the commit); a dependent of a step that
-- failed for good or was cancelled ends cancelled, unless its edge says run_on_failure. Run only
-- for batches that hold such steps: a batch of plain tasks never runs it.
-- It says in which queues steps became ready (the claim that follows in the transaction reads
-- them). The queues named `quiet` are not woken: the caller claims in them next, and wakes them
-- itself (wake_queues) if its claim may have left a ready step behind.
SELECT released, ready_queues
  FROM {schema}.settle_steps_ready(%(ids)s::bigint[], %(quiet)s::text[]);

-- name: wake_queues
-- Wake the workers of these queues at the commit (the notification a new row sends): steps made
-- ready that the acknowledging worker's own claim did not take.
SELECT {schema}.wake_steps(%(queues)s::text[], now());
