-- Results and waiting: where tasks stand, for waiters.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: task_outcomes
-- Where these tasks stand, for waiters: one primary-key look-up per id (array text, see
-- the store.int_array) in the task table and in each slot of the history (task_rows,
-- schema/0025). A task missing from the answer does not exist (any more).
SELECT t.id, t.state::text, t.result, t.last_error
  FROM {schema}.task_rows AS t
 WHERE t.id = ANY(%(ids)s::bigint[]);
