-- 0003: a task's max_attempts comes from its handler unless the producer sets it.
--
-- Before, the column defaulted to 5, so `INSERT INTO tasks (task) VALUES ('x')` gave x five
-- attempts even when its handler was registered with max_attempts=2, and a SQL producer had to
-- repeat each handler's setting. Now NULL means "the handler decides": the claiming worker fills in
-- its handler's max_attempts (5 when it has none) in the claim statement, so every row that is or
-- was in progress carries a number and retry, rescue and the status page keep working from the
-- row alone. A value set by the producer (or raised later by an operator) still wins. Existing
-- rows keep their numbers.
--
-- Deploy it with workers of the same release: an older worker's claim does not fill the number
-- in, and its retry would requeue such a row without limit until a current worker claims it.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.tasks
    ALTER COLUMN max_attempts DROP NOT NULL,
    ALTER COLUMN max_attempts DROP DEFAULT;

-- enqueue(): as in 0001, with max_attempts NULL ("the handler decides") unless given.
CREATE OR REPLACE FUNCTION {schema}.enqueue(
    task         text,
    payload      jsonb       DEFAULT '{}',
    queue        text        DEFAULT 'default',
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
        INSERT INTO {schema}.tasks AS t (task, payload, queue, run_at, priority, max_attempts, dedupe_key)
        VALUES (enqueue.task, coalesce(enqueue.payload, '{}'), coalesce(enqueue.queue, 'default'),
                coalesce(enqueue.run_at, now()), coalesce(enqueue.priority, 0),
                enqueue.max_attempts, enqueue.dedupe_key)
        ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL AND state IN ('queued', 'in_progress')
        DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
        SELECT t.id INTO new_id FROM {schema}.tasks AS t
         WHERE t.dedupe_key = enqueue.dedupe_key AND t.state IN ('queued', 'in_progress');
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'enqueue: could not settle dedupe_key % (is the transaction REPEATABLE READ?)',
        enqueue.dedupe_key;
END;
$$;
