-- `worker bench`'s workflow phases: their reads, from the database clock.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: bench_flow_join
-- The join of a fan-out: its state, and how long after the last of its inputs' acknowledgement
-- it started (its started_at minus the latest finished_at of the steps it waits for), in ms. Both
-- are transaction times: a claim whose transaction began before the acknowledgement committed
-- reads slightly below 0.
SELECT j.state::text,
       extract(epoch FROM j.started_at - (SELECT max(p.finished_at)
                                           FROM {schema}.task_deps AS d
                                           JOIN {schema}.tasks AS p ON p.id = d.depends_on
                                          WHERE d.task_id = j.id)) * 1000 AS start_ms
  FROM {schema}.tasks AS j
 WHERE j.id = %(id)s;

-- name: bench_flow_span
-- A workflow's steps done, and the seconds from its first start to its last finish.
SELECT count(*) FILTER (WHERE t.state = 'done') AS done,
       extract(epoch FROM max(t.finished_at) - min(t.started_at)) AS seconds
  FROM {schema}.tasks AS t
 WHERE t.workflow_id = %(id)s;

-- name: bench_flow_hops
-- A chain's hops: from each step's acknowledgement to its successor's, in ms (the successor's
-- claim, run and acknowledgement). A step's claim commits with its predecessor's
-- acknowledgement, at the same transaction time: the time from one to the other is always 0.
SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY x.ms) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY x.ms) AS p99,
       max(x.ms) AS worst
  FROM (SELECT extract(epoch FROM c.finished_at - p.finished_at) * 1000 AS ms
          FROM {schema}.task_deps AS d
          JOIN {schema}.tasks AS c ON c.id = d.task_id
          JOIN {schema}.tasks AS p ON p.id = d.depends_on
         WHERE c.workflow_id = %(id)s) AS x;
