-- Bulk retry, cancel and delete by filter, and the record of operator actions (schema/0008 holds
-- the logic, as functions that psql can call too; these are the calls the Python side makes).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: bulk_step
-- One batch of one walk: see schema/0008, bulk_step. Runs in a transaction of its own.
SELECT examined, matched, changed, skipped, sample, next_cursor
  FROM {schema}.bulk_step(%(action)s, %(states)s::text[], %(filter)s::jsonb, %(cursor)s::jsonb,
                          %(batch)s, %(dry_run)s);

-- name: bulk_states
-- The states an action walks for a filter's "states" (NULL: the action's default); raises for a
-- state the action does not apply to.
SELECT {schema}.bulk_states(%(action)s, %(states)s::text[]) AS states;

-- name: bulk_running
-- Running tasks a filter matches (which bulk actions never touch), up to %(cap)s, and a few ids.
SELECT running, sample FROM {schema}.bulk_running(%(filter)s::jsonb, %(cap)s);

-- name: bulk_examples
-- A few of the tasks a bulk action matched, for its dry run. Names and errors cut to %(chars)s.
SELECT t.id, t.state::text AS state, left(t.queue, %(chars)s) AS queue,
       left(t.task, %(chars)s) AS task, t.attempts, t.created_at, t.finished_at,
       left(t.last_error, %(chars)s) AS last_error
  FROM {schema}.tasks AS t
 WHERE t.id = ANY(%(ids)s::bigint[])
 ORDER BY t.id;

-- name: action_record
-- One row in the record of operator actions (schema/0008, actions); `finished` false for an action
-- that starts now and reports its counts when it ends (action_finish).
SELECT {schema}.record_action(%(actor)s, %(action)s, %(filter)s::jsonb, %(counts)s::jsonb,
                              %(source)s, %(finished)s) AS id;

-- name: action_finish
SELECT {schema}.finish_action(%(id)s, %(counts)s::jsonb, %(finished)s);

-- name: actions_recent
-- The newest operator actions, newest first, from actions_at_idx.
SELECT id, at, finished_at, actor, source, action, filter, counts
  FROM {schema}.actions
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;
