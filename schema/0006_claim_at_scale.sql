-- 0006: a claim whose cost does not grow with delayed work, routing by handler, and
-- notifications only for rows that can run.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- Delayed rows leave the claim index. A row inserted with a future run_at becomes 'scheduled'
-- (the trigger below); workers promote due rows to 'queued' (queries/tasks.sql, promote), so the
-- claim index holds only rows that can run now. Existing delayed rows move over here.
UPDATE {schema}.tasks SET state = 'scheduled' WHERE state = 'queued' AND run_at > now();

-- Promotion reads the earliest scheduled rows and stops at the first one not yet due.
CREATE INDEX tasks_scheduled_idx ON {schema}.tasks (run_at) WHERE state = 'scheduled';

-- A scheduled row holds its dedupe key like a queued one.
DROP INDEX {schema}.tasks_dedupe_idx;
CREATE UNIQUE INDEX tasks_dedupe_idx ON {schema}.tasks (dedupe_key)
    WHERE dedupe_key IS NOT NULL AND state IN ('scheduled', 'queued', 'in_progress');

-- How many times workers without the task's handler handed the row back (it was not counted as
-- an attempt; see queries/tasks.sql, defer_unknown). A worker that has the handler takes such rows
-- at once when it starts.
ALTER TABLE {schema}.tasks ADD COLUMN handed_back integer NOT NULL DEFAULT 0;
-- On the name's first 255 characters: rows from before 0004 may have names too long for an
-- index entry, and must not make the hand-back fail.
CREATE INDEX tasks_handed_back_idx ON {schema}.tasks (left(task, 255))
    WHERE handed_back > 0 AND state = 'scheduled';

-- Routing: each worker records the queue of every task it has a handler for. A row inserted
-- without a queue (a plain INSERT, worker.enqueue() in SQL, the CLI, or Python without the
-- handler's module imported) lands in that queue; in 'default' when no worker has declared the
-- task yet.
CREATE TABLE {schema}.task_routes (
    task        text        PRIMARY KEY,
    queue       text        NOT NULL,
    declared_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT task_routes_task_length CHECK (char_length(task) BETWEEN 1 AND 255),
    CONSTRAINT task_routes_queue_length CHECK (char_length(queue) BETWEEN 1 AND 255)
);

ALTER TABLE {schema}.tasks ALTER COLUMN queue DROP DEFAULT;

-- What each worker process can run, for `worker status`: tasks waiting for a handler that no
-- live worker has.
ALTER TABLE {schema}.workers ADD COLUMN tasks text[] NOT NULL DEFAULT '{}';

-- Fills in the queue of a row inserted without one, and files a row that is not due yet as
-- 'scheduled'. The trigger's WHEN clause keeps the common insert (a queue given, due now) from
-- calling the function at all, so COPY stays close to its bare speed.
-- SECURITY DEFINER: a producer role that may only insert tasks (deploy/sql/roles.sql) still gets
-- its rows routed; the function reads task_routes and nothing else.
CREATE FUNCTION {schema}.before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.queue IS NULL THEN
        NEW.queue := coalesce(
            (SELECT r.queue FROM {schema}.task_routes AS r WHERE r.task = NEW.task), 'default');
    END IF;
    IF NEW.state = 'queued' AND NEW.run_at > now() THEN
        NEW.state := 'scheduled';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER tasks_before_insert
    BEFORE INSERT ON {schema}.tasks
    FOR EACH ROW
    WHEN (NEW.queue IS NULL OR (NEW.state = 'queued' AND NEW.run_at > now()))
    EXECUTE FUNCTION {schema}.before_insert();

-- Notify only when the statement inserted rows that can run now, and say in which queues (up to
-- a few thousand bytes of names; an empty payload means "look at every queue"). A dedupe hit
-- (ON CONFLICT DO NOTHING) or a delayed row no longer wakes anyone.
DROP TRIGGER tasks_notify_inserted ON {schema}.tasks;
CREATE OR REPLACE FUNCTION {schema}.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    names text;
BEGIN
    SELECT string_agg(q, ',') INTO names
      FROM (SELECT DISTINCT queue AS q FROM inserted WHERE state = 'queued' LIMIT 50) AS d;
    IF names IS NOT NULL THEN
        IF octet_length(names) > 7000 THEN
            names := '';
        END IF;
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.tasks', names);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER tasks_notify_inserted
    AFTER INSERT ON {schema}.tasks
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_inserted();

-- enqueue(): the queue defaults to the task's route (see above). A dedupe key already held is
-- answered before any insert, so a hit neither inserts nor notifies.
-- CREATE OR REPLACE (same signature) keeps the grants an operator gave on it.
CREATE OR REPLACE FUNCTION {schema}.enqueue(
    task         text,
    payload      jsonb       DEFAULT '{}',
    queue        text        DEFAULT NULL,
    run_at       timestamptz DEFAULT now(),
    priority     integer     DEFAULT 0,
    max_attempts integer     DEFAULT NULL,
    dedupe_key   text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    new_id bigint;
BEGIN
    -- The loop covers one race: the task holding the key finishes between our failed insert and
    -- our look-up. Under READ COMMITTED each statement sees the latest commits, so it ends at once.
    FOR i IN 1..10 LOOP
        IF enqueue.dedupe_key IS NOT NULL THEN
            SELECT t.id INTO new_id FROM {schema}.tasks AS t
             WHERE t.dedupe_key = enqueue.dedupe_key
               AND t.state IN ('scheduled', 'queued', 'in_progress');
            IF new_id IS NOT NULL THEN
                RETURN new_id;
            END IF;
        END IF;
        INSERT INTO {schema}.tasks AS t (task, payload, queue, run_at, priority, max_attempts, dedupe_key)
        VALUES (enqueue.task, coalesce(enqueue.payload, '{}'), enqueue.queue,
                coalesce(enqueue.run_at, now()), coalesce(enqueue.priority, 0),
                enqueue.max_attempts, enqueue.dedupe_key)
        ON CONFLICT (dedupe_key)
            WHERE dedupe_key IS NOT NULL AND state IN ('scheduled', 'queued', 'in_progress')
        DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'enqueue: could not settle dedupe_key % (is the transaction REPEATABLE READ?)',
        enqueue.dedupe_key;
END;
$$;
