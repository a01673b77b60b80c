-- 0011: pause and resume a queue from SQL, as the CLI, the Python API and the console do (they
-- call these functions, so every path shares one definition).
--
-- A paused queue (a row in paused_queues, schema/0009) gives nothing to any claim from the
-- moment the pause commits; tasks already running finish. Resuming deletes the row and notifies
-- the queue's workers on the insert trigger's channel, so its backlog starts at once.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE FUNCTION {schema}.pause_queue(queue text, paused_by text DEFAULT current_user)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    IF pause_queue.queue IS NULL OR pause_queue.queue = ''
            OR char_length(pause_queue.queue) > 255 THEN
        RAISE EXCEPTION 'a queue name is 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    INSERT INTO {schema}.paused_queues (queue, paused_by)
    VALUES (pause_queue.queue, left(coalesce(pause_queue.paused_by, ''), 200))
    ON CONFLICT (queue) DO NOTHING;
    RETURN FOUND;  -- false: it was paused already, and its first pause stands
END;
$$;

CREATE FUNCTION {schema}.resume_queue(queue text)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    DELETE FROM {schema}.paused_queues AS p WHERE p.queue = resume_queue.queue;
    IF NOT FOUND THEN
        RETURN false;  -- it was not paused
    END IF;
    -- The channel of the insert trigger (schema/0006): the schema's name and '.tasks'.
    PERFORM pg_notify(n.nspname || '.tasks', resume_queue.queue)
       FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
      WHERE c.oid = '{schema}.tasks'::regclass;
    RETURN true;
END;
$$;
