-- The console's page of one workflow (schema/0022): its row, its steps counted by state, and one
-- page of its steps in dependency order (by id: every step's dependencies have lower ids).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.
-- Every read walks tasks_workflow_idx (workflow_id, id) of this workflow alone; names and errors
-- come cut, as on the job pages.

-- name: console_workflow
SELECT w.id, left(w.name, 255) AS name, w.created_at
  FROM {schema}.workflows AS w
 WHERE w.id = %(id)s;

-- name: console_workflow_counts
-- The workflow's steps by state, in one aggregate, with when its first step started and its last
-- finished.
SELECT t.state::text AS state, count(*) AS n, min(t.started_at) AS first_started,
       max(t.finished_at) AS last_finished
  FROM {schema}.tasks AS t
 WHERE t.workflow_id = %(id)s
 GROUP BY t.state;

-- name: console_workflow_steps
-- One page of steps after step %(after)s (0: from the first), %(limit)s of them and one more to
-- say whether a next page exists; only those in %(state)s when it is given. Each with the first
-- %(deps)s of its dependencies by id, what each came to (the edge's outcome: NULL until it
-- finished), and how many it has (counted up to %(deps_cap)s). Only a step that has dependencies
-- looks for its edges: where one join holds most of them, the planner expects every step to have
-- as many, and would walk every edge for each step of the page.
SELECT t.id, left(t.task, %(name_chars)s) AS task, char_length(t.task) AS task_length,
       left(t.queue, %(name_chars)s) AS queue, char_length(t.queue) AS queue_length,
       t.state::text AS state, t.attempts, t.max_attempts, t.pending_deps,
       t.run_at, t.started_at, t.finished_at, left(t.cancelled_by, 200) AS cancelled_by,
       extract(epoch FROM coalesce(t.finished_at, now()) - t.started_at)::float8 AS seconds,
       left(t.last_error, %(chars)s) AS last_error,
       CASE WHEN pg_column_size(t.last_error) <= %(stored)s THEN char_length(t.last_error)
            ELSE octet_length(t.last_error) END AS last_error_length,
       -- pending_deps is NULL for a step that never had a dependency: no edge to look for.
       CASE WHEN t.pending_deps IS NOT NULL THEN
       (SELECT coalesce(jsonb_agg(jsonb_build_object('id', d.depends_on, 'outcome', d.outcome,
                                                     'run_on_failure', d.run_on_failure)
                                  ORDER BY d.depends_on), '[]')
          FROM (SELECT d.depends_on, d.outcome, d.run_on_failure
                  FROM {schema}.task_deps AS d
                 WHERE d.task_id = t.id
                 ORDER BY d.depends_on
                 LIMIT %(deps)s) AS d) END AS deps,
       CASE WHEN t.pending_deps IS NOT NULL THEN
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.task_deps AS d
                               WHERE d.task_id = t.id LIMIT %(deps_cap)s) AS c) END AS deps_total
  FROM {schema}.tasks AS t
 WHERE t.workflow_id = %(id)s AND t.id > %(after)s
   AND (%(state)s::text IS NULL OR t.state::text = %(state)s)
 ORDER BY t.id
 LIMIT %(limit)s + 1;
