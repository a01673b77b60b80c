-- Operator actions that change task rows: retry, cancel, delete, and bulk steps by filter.
-- Each statement re-checks the state of every row it touches.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: requeue
-- The one retry (schema/0016, requeue): failed or cancelled tasks among %(ids)s back to queued,
-- those whose dedupe key is taken left as they are; idle workers are woken. `dry_run` only says.
SELECT r.requeued, r.skipped FROM {schema}.requeue(%(ids)s::bigint[], %(dry_run)s) AS r;

-- name: cancel_tasks
-- Cancel each of %(ids)s, for %(by)s (NULL: the database role): a task that has not started is
-- cancelled at once, a running one is marked and its worker told (NOTIFY). One row per id, in
-- the order given: (id, outcome, state); see the function in schema/0010 for the outcomes. The
-- same function serves psql users, so Python and SQL cancel alike.
SELECT c.id, c.outcome, c.state
  FROM {schema}.cancel_tasks(%(ids)s::bigint[], %(by)s::text) AS c;

-- name: cancel_workflow
-- Cancel every step of workflow %(id)s that has not finished, for %(by)s (NULL: the database
-- role): waiting, scheduled and queued steps end cancelled at once, running ones are marked and
-- their workers told (schema/0022, cancel_workflow, through cancel_tasks). Returns how many steps
-- were cancelled or asked to stop.
SELECT {schema}.cancel_workflow(%(id)s::bigint, %(by)s::text);

-- name: delete_tasks
-- Delete the tasks among %(ids)s that no worker is running (a running task's worker would find
-- its row gone: cancel it or let it finish first), in the task table or the history
-- (schema/0025); returns how many.
WITH gone AS (
    DELETE FROM {schema}.tasks AS t
     WHERE t.id = ANY(%(ids)s::bigint[]) AND t.state <> 'in_progress'
    RETURNING 1
), gone_history AS (
    DELETE FROM {schema}.task_history AS h
     WHERE h.id = ANY(%(ids)s::bigint[])
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM gone_history);

-- name: bulk_step
-- One batch of one walk: see schema/0008, bulk_step. Runs in a transaction of its own.
SELECT examined, matched, changed, skipped, sample, next_cursor
  FROM {schema}.bulk_step(%(action)s, %(states)s::text[], %(filter)s::jsonb, %(cursor)s::jsonb,
                          %(batch)s, %(dry_run)s);

-- name: wake
-- Rows put back in the queue by an operator: wake idle workers as an INSERT would.
SELECT pg_notify(%(channel)s, '');
