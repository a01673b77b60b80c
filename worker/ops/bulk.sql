-- Bulk retry, cancel and delete by filter: the reads around the store's bulk_step (schema/0008).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: bulk_states
-- The states an action walks for a filter's "states" (NULL: the action's default); raises for a
-- state the action does not apply to.
SELECT {schema}.bulk_states(%(action)s, %(states)s::text[]) AS states;

-- name: bulk_running
-- Running tasks a filter matches (which bulk actions never touch), up to %(cap)s, and a few ids.
SELECT running, sample FROM {schema}.bulk_running(%(filter)s::jsonb, %(cap)s);

-- name: bulk_examples
-- A few of the tasks a bulk action matched, for its dry run, from the task table or the
-- history (task_rows, schema/0025). Names and errors cut to %(chars)s.
SELECT t.id, t.state::text AS state, left(t.queue, %(chars)s) AS queue,
       left(t.task, %(chars)s) AS task, t.attempts, t.created_at, t.finished_at,
       left(t.last_error, %(chars)s) AS last_error
  FROM {schema}.task_rows AS t
 WHERE t.id = ANY(%(ids)s::bigint[])
 ORDER BY t.id;
