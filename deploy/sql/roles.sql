-- Least-privilege roles for a worker installation. Run as the role that owns the schema (the one
-- that runs `worker migrate`), after every migration, with psql:
--
--   psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f deploy/sql/roles.sql
--   psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -v schema=jobs -v producer_role=jobs_producer \
--        -v worker_role=jobs_worker -f deploy/sql/roles.sql
--
-- It creates two group roles (NOLOGIN) and grants them exactly what they need; give them to
-- login roles with GRANT:
--
--   CREATE ROLE web_app LOGIN PASSWORD '...' IN ROLE worker_producer;   -- enqueues only
--   CREATE ROLE queue_worker LOGIN PASSWORD '...' IN ROLE worker_runner; -- runs `worker run`
--
-- Re-running is safe: every grant is first revoked, so the roles end up with exactly this list.
--
-- worker_producer: enqueue and nothing else. It calls {schema}.enqueue() or inserts rows itself
--   (COPY, as worker.enqueue_many does), but only into the columns a producer sets: it cannot
--   write a state, an owner or an attempt count, and it cannot update, delete or read payloads.
--   enqueue() runs with the caller's rights, so the producer may read three columns (id,
--   dedupe_key, state): the function returns the id and looks up the task holding a dedupe key.
-- worker_runner: what `worker run`, `worker status` and the metrics server do: read and change
--   task, worker, lock and cron rows. It reads the migration table but cannot write it, and it
--   owns nothing, so it cannot alter or drop the tables. Migrations stay with the owner.

\if :{?schema}
\else
  \set schema worker
\endif
\if :{?producer_role}
\else
  \set producer_role worker_producer
\endif
\if :{?worker_role}
\else
  \set worker_role worker_runner
\endif

BEGIN;

SELECT format('CREATE ROLE %I NOLOGIN', r)
  FROM unnest(ARRAY[:'producer_role', :'worker_role']) AS r
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r)
\gexec

-- Start from nothing.
REVOKE ALL ON ALL TABLES IN SCHEMA :"schema" FROM :"producer_role", :"worker_role";
REVOKE ALL ON ALL SEQUENCES IN SCHEMA :"schema" FROM :"producer_role", :"worker_role";
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA :"schema" FROM :"producer_role", :"worker_role";
REVOKE ALL ON SCHEMA :"schema" FROM :"producer_role", :"worker_role";
-- PostgreSQL lets PUBLIC execute every new function; only these roles should call enqueue().
-- (Functions run with the caller's rights, so this is tidiness rather than a hole closed.)
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA :"schema" FROM PUBLIC;

-- The producer.
GRANT USAGE ON SCHEMA :"schema" TO :"producer_role";
GRANT EXECUTE ON FUNCTION
    :"schema".enqueue(text, jsonb, text, timestamptz, integer, integer, text, jsonb)
    TO :"producer_role";
GRANT INSERT (task, payload, queue, priority, run_at, max_attempts, dedupe_key, trace_context)
    ON :"schema".tasks TO :"producer_role";
GRANT SELECT (id, dedupe_key, state) ON :"schema".tasks TO :"producer_role";
GRANT USAGE ON SEQUENCE :"schema".tasks_id_seq TO :"producer_role";

-- The worker.
GRANT USAGE ON SCHEMA :"schema" TO :"worker_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA :"schema" TO :"worker_role";
REVOKE INSERT, UPDATE, DELETE ON :"schema".schema_migrations FROM :"worker_role";
GRANT USAGE ON ALL SEQUENCES IN SCHEMA :"schema" TO :"worker_role";
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA :"schema" TO :"worker_role";
-- Retention empties the history's slots whole (rotate_history), and nothing else.
GRANT TRUNCATE ON :"schema".task_history_1, :"schema".task_history_2, :"schema".task_history_3,
                  :"schema".task_history_4, :"schema".task_history_5, :"schema".task_history_6,
                  :"schema".task_history_7, :"schema".task_history_8 TO :"worker_role";

-- Tables a later migration creates (as this same owner) reach the worker without a re-run;
-- re-run anyway after upgrading, so that the revokes above apply to new objects too.
ALTER DEFAULT PRIVILEGES IN SCHEMA :"schema"
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"worker_role";
ALTER DEFAULT PRIVILEGES IN SCHEMA :"schema"
    GRANT USAGE ON SEQUENCES TO :"worker_role";
ALTER DEFAULT PRIVILEGES IN SCHEMA :"schema"
    GRANT EXECUTE ON FUNCTIONS TO :"worker_role";

COMMIT;
