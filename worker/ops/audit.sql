-- The record of operator actions (schema/0008 and 0016, `actions`): one row per action, from the
-- CLI, the console, psql or the Python API.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: action_record
-- One row in the record of operator actions; `finished` false for an action that starts now and
-- reports its counts when it ends (action_finish).
SELECT {schema}.record_action(%(actor)s, %(action)s, %(filter)s::jsonb, %(counts)s::jsonb,
                              %(source)s, %(finished)s, %(address)s) AS id;

-- name: action_finish
-- The counts of an action (NULL: keep them) and how it ended: finished, interrupted by a signal
-- between two batches (finished_at set too), or neither (still running).
SELECT {schema}.finish_action(%(id)s, %(counts)s::jsonb, %(finished)s, %(interrupted)s::text);

-- name: actions_recent
-- The newest operator actions, newest first, from actions_at_idx.
SELECT id, at, finished_at, actor, source, address, action, filter, counts, interrupted
  FROM {schema}.actions
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;
