-- 0010: cancelling running tasks.
--
-- A task that has not started (scheduled or queued) is cancelled at once, as before. A running
-- one cannot be stopped from the database: its row is marked (cancel_requested_at, cancelled_by),
-- its worker is told (NOTIFY on the channel '<schema>.tasks_cancel', and the worker's lease keeper
-- reads the mark as a fallback), and the worker stops the handler. Every statement that takes a
-- row out of in_progress (queries/tasks.sql: complete, retry, release, hand_back, rescue,
-- worker_died) ends a marked row 'cancelled' instead, so a handler that ignores the request, a
-- worker that dies, or a graceful stop can never record it done or put it back in the queue.
--
-- Both columns are nullable without a default: adding them rewrites nothing, and no index is
-- added (the worker reads the mark by primary key, for the rows it holds).
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- When someone asked to cancel the task (for a task cancelled before it started, when it was
-- cancelled), and who: the name given to cancel_task(), by default the database role.
ALTER TABLE {schema}.tasks
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancelled_by        text;

-- cancel_tasks(): cancel each of `ids`. One row per id given, saying what happened to it:
--   outcome 'cancelled'  it had not started (scheduled or queued): it is cancelled now;
--           'requested'  it is running: its worker will stop it (a second request keeps the
--                        first one's time and name);
--           'finished'   it had already ended (`state` says how): nothing changed;
--           'missing'    no such task.
-- `state` is the task's state as this function left it (NULL for a missing one).
--
-- Races: a row claimed while this runs is waited for and then asked to stop; a running row
-- that a worker finishes meanwhile is reported finished. Each pass takes the rows it changes
-- with row locks, and passes repeat while a listed row still moved under them (at most five).
-- A worker's acknowledgement locks its rows too, so the request lands either before it (the row
-- ends 'cancelled') or after (the row is done and this says 'finished'), never in between.
CREATE FUNCTION {schema}.cancel_tasks(ids bigint[], by text DEFAULT current_user)
RETURNS TABLE (id bigint, outcome text, state text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    who      text := left(coalesce(cancel_tasks.by, current_user), 200);
    ended    bigint[] := '{}';
    asked    bigint[] := '{}';
    got      bigint[];
    names    text;
    channel  text;
BEGIN
    FOR pass IN 1..5 LOOP
        -- Not started: cancelled now, with who and when.
        WITH moved AS (
            UPDATE {schema}.tasks AS t
               SET state = 'cancelled', finished_at = now(),
                   cancel_requested_at = now(), cancelled_by = who
             WHERE t.id = ANY(cancel_tasks.ids) AND t.state IN ('scheduled', 'queued')
            RETURNING t.id
        )
        SELECT coalesce(array_agg(moved.id), '{}') INTO got FROM moved;
        ended := ended || got;
        -- Running: marked for its worker.
        WITH marked AS (
            UPDATE {schema}.tasks AS t
               SET cancel_requested_at = now(), cancelled_by = who
             WHERE t.id = ANY(cancel_tasks.ids) AND t.state = 'in_progress'
               AND t.cancel_requested_at IS NULL
            RETURNING t.id
        )
        SELECT coalesce(array_agg(marked.id), '{}') INTO got FROM marked;
        asked := asked || got;
        -- A row that went from running back to the queue (or the other way) between the two
        -- statements is taken by the next pass.
        EXIT WHEN NOT EXISTS (
            SELECT 1 FROM {schema}.tasks AS t
             WHERE t.id = ANY(cancel_tasks.ids)
               AND (t.state IN ('scheduled', 'queued')
                    OR (t.state = 'in_progress' AND t.cancel_requested_at IS NULL)));
    END LOOP;
    IF cardinality(asked) > 0 THEN
        -- The channel carries the schema's own name (as the insert trigger's does); the payload
        -- lists the ids, or is empty when they would not fit ("check every task you hold").
        SELECT n.nspname || '.tasks_cancel' INTO channel
          FROM pg_catalog.pg_class AS c
          JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = '{schema}.tasks'::regclass;
        names := array_to_string(asked, ',');
        PERFORM pg_notify(channel, CASE WHEN octet_length(names) > 7000 THEN '' ELSE names END);
    END IF;
    RETURN QUERY
    SELECT i.id,
           CASE WHEN i.id = ANY(ended) THEN 'cancelled'
                WHEN t.id IS NULL THEN 'missing'
                WHEN t.state = 'in_progress' THEN 'requested'
                ELSE 'finished' END,
           t.state::text
      FROM unnest(cancel_tasks.ids) WITH ORDINALITY AS i(id, n)
      LEFT JOIN {schema}.tasks AS t ON t.id = i.id
     ORDER BY i.n;
END;
$$;

-- cancel_task(): the same for one task, for psql users; returns the outcome above.
--   SELECT worker.cancel_task(42);                 -- by the current database role
--   SELECT worker.cancel_task(42, 'alice');
CREATE FUNCTION {schema}.cancel_task(id bigint, by text DEFAULT current_user)
RETURNS text
LANGUAGE sql AS $$
    SELECT c.outcome FROM {schema}.cancel_tasks(ARRAY[cancel_task.id], cancel_task.by) AS c;
$$;
