-- What operators read of workflows (schema/0022): one workflow's steps, and the counts the
-- metrics show. Each block starts with `-- name: NAME`; {schema} is the quoted schema name.

-- name: workflow_get
SELECT id, name, created_at FROM {schema}.workflows WHERE id = %(id)s;

-- name: workflow_steps
-- A workflow's steps in the order they were inserted (dependencies first), at most %(limit)s,
-- with what each waits for and how it went.
SELECT t.id, t.task, t.queue, t.state::text AS state, t.attempts, t.pending_deps,
       ARRAY(SELECT d.depends_on FROM {schema}.task_deps AS d
              WHERE d.task_id = t.id ORDER BY d.position, d.depends_on) AS depends_on,
       t.created_at, t.started_at, t.finished_at,
       extract(epoch FROM t.finished_at - t.started_at)::float8 AS seconds,
       t.last_error
  FROM {schema}.tasks AS t
 WHERE t.workflow_id = %(id)s
 ORDER BY t.id
 LIMIT %(limit)s;

-- name: workflow_counts
-- A workflow's steps by state.
SELECT t.state::text AS state, count(*) AS n
  FROM {schema}.tasks AS t
 WHERE t.workflow_id = %(id)s
 GROUP BY 1;

-- name: metrics_workflows
-- Steps of workflows that have not finished, by state, the waiting ones by queue too, and the
-- workflows they belong to (up to %(cap)s steps read: a bounded scan of the workflow index).
-- `g` says which grouping a row is: 1 a state's steps, 2 a queue's waiting steps (the row with
-- no queue counts the steps that are not waiting), 3 every step read, with every such workflow
-- counted once.
SELECT s.state, s.waiting_in, count(*) AS steps, count(DISTINCT s.workflow_id) AS workflows,
       GROUPING(s.state, s.waiting_in) AS g
  FROM (SELECT t.state::text AS state, t.workflow_id,
               CASE WHEN t.state = 'waiting' THEN t.queue END AS waiting_in
          FROM {schema}.tasks AS t
         WHERE t.workflow_id IS NOT NULL
           AND t.state IN ('waiting', 'scheduled', 'queued', 'in_progress')
         LIMIT %(cap)s) AS s
 GROUP BY GROUPING SETS ((s.state), (s.waiting_in), ());
