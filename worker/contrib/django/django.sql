-- The Django backend's reads.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: django_result
-- One task as Django's TaskResult shows it (get_result): one primary-key look-up in the task
-- table and in each slot of the history (task_rows, schema/0025). JSON comes as text, decoded by
-- the backend: Django's connection loads jsonb as text anyway.
SELECT t.id, t.task, t.state::text, t.payload::text, t.result::text, t.last_error,
       t.errors::text, t.attempts,
       t.worker_id::text, t.created_at, t.started_at, t.finished_at
  FROM {schema}.task_rows AS t
 WHERE t.id = %(id)s;
