-- 0024: finished tasks leave the claim table: a history in slices, emptied a whole slice at a time.
--
-- Until now a finished task stayed in `tasks` for its retention (an hour by default), sharing the
-- claim path's heap and indexes, and retention deleted it there in batches: each task left three
-- dead row versions (claim, finish, delete), and the table and the cost of a task grew with the
-- throughput times the retention. Now an acknowledgement can move a plain task that ends 'done'
-- out of `tasks` into `task_history` in the same statement (DELETE ... RETURNING, then INSERT),
-- and retention empties the history a slice at a time with TRUNCATE instead of deleting rows.
--
-- `task_history` has the columns of `tasks` plus `slot`, and is partitioned by `slot` into a
-- fixed ring of eight partitions, `task_history_1` to `task_history_8`; `history_slots` says
-- which slot receives rows now ('current', exactly one), which hold rows ('closed', since
-- closed_at) and which are empty. `rotate_history` (run by every worker's maintenance, no leader)
-- closes the current slot once it is a slice old (the retention / 6 by default) and opens the
-- next empty one, and empties the closed slots whose rows are all past their retention. A slot
-- is emptied by TRUNCATE under a short lock_timeout: a reader by id that holds the slot's lock
-- makes it wait for the next pass, never the reader for long. The ring never opens a slot that
-- still holds rows; while none is free the current slot keeps its rows longer.
--
-- Only rows the acknowledgement can move go to the history: plain tasks (no workflow, no cron
-- slot, no cancel request) that end 'done', with or without a result. Everything else finishes
-- in `tasks` as before and retention deletes it there. Rows finished before this migration stay
-- in `tasks` until retention deletes them: nothing is copied, and nothing here locks `tasks`
-- beyond the instant a view needs.
--
-- `task_rows` is every task in either table, for reads by id; a row is in exactly one of them in
-- any snapshot. A migration that adds a column to `tasks` adds it to `task_history` and to
-- `task_rows` too.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE TABLE {schema}.history_slots (
    slot      smallint PRIMARY KEY,
    state     text NOT NULL DEFAULT 'empty',
    opened_at timestamptz,
    closed_at timestamptz,
    CONSTRAINT history_slots_slot CHECK (slot BETWEEN 1 AND 8),
    CONSTRAINT history_slots_state CHECK (state IN ('current', 'closed', 'empty')),
    CONSTRAINT history_slots_times CHECK (
        (state = 'current') = (opened_at IS NOT NULL)
        AND (state = 'closed') = (closed_at IS NOT NULL))
);

CREATE UNIQUE INDEX history_slots_current_idx ON {schema}.history_slots ((true))
    WHERE state = 'current';

INSERT INTO {schema}.history_slots (slot, state, opened_at)
SELECT s, CASE WHEN s = 1 THEN 'current' ELSE 'empty' END, CASE WHEN s = 1 THEN now() END
  FROM generate_series(1, 8) AS s;

CREATE TABLE {schema}.task_history (
    LIKE {schema}.tasks INCLUDING DEFAULTS,
    slot smallint NOT NULL
) PARTITION BY LIST (slot);

ALTER TABLE {schema}.task_history ADD PRIMARY KEY (id, slot);

-- The finished lists and counts read finished rows newest first.
CREATE INDEX task_history_finished_idx ON {schema}.task_history (finished_at);

DO $$
BEGIN
    FOR s IN 1..8 LOOP
        -- Rows are written once and emptied by TRUNCATE: nothing for autovacuum to do but
        -- read them.
        EXECUTE format('CREATE TABLE %s PARTITION OF %s FOR VALUES IN (%s) '
                       'WITH (autovacuum_enabled = false)',
                       '{schema}.' || quote_ident('task_history_' || s), '{schema}.task_history', s);
    END LOOP;
END;
$$;

CREATE VIEW {schema}.task_rows AS
SELECT id, queue, task, payload, priority, run_at, state, attempts, max_attempts, last_error,
       dedupe_key, cron_key, cron_at, worker_id, lease_expires_at, created_at, started_at,
       finished_at, handed_back, errors, cancel_requested_at, cancelled_by, result,
       trace_context, limit_key, limit_held, workflow_id, pending_deps, dependents, inputs
  FROM {schema}.tasks
UNION ALL
SELECT id, queue, task, payload, priority, run_at, state, attempts, max_attempts, last_error,
       dedupe_key, cron_key, cron_at, worker_id, lease_expires_at, created_at, started_at,
       finished_at, handed_back, errors, cancel_requested_at, cancelled_by, result,
       trace_context, limit_key, limit_held, workflow_id, pending_deps, dependents, inputs
  FROM {schema}.task_history;

-- Rotation: any worker, any number at once (the current slot's row lock lets one through; the
-- others return at once). keep_seconds: the retention of done rows; a slot is emptied once its
-- newest row is that old. slice_seconds: how long a slot receives rows (default keep / 6, so
-- that six closed slots and the current one cover the retention and one is free to open).
-- Returns the number of slots emptied.
CREATE FUNCTION {schema}.rotate_history(keep_seconds double precision,
                                        slice_seconds double precision DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    cur     {schema}.history_slots;
    nxt     smallint;
    slice   interval := make_interval(secs => coalesce(slice_seconds, keep_seconds / 6));
    emptied integer := 0;
    s       smallint;
    held    boolean;
BEGIN
    SELECT * INTO cur FROM {schema}.history_slots WHERE state = 'current' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 0;  -- another worker rotates right now
    END IF;
    -- A slot is emptied only when no transaction holds it: wait 50 ms at most, then leave it to
    -- the next pass (readers by id lock every slot, and must not queue behind the TRUNCATE).
    PERFORM set_config('lock_timeout', '50ms', true);
    FOR s IN SELECT h.slot FROM {schema}.history_slots AS h
              WHERE h.state = 'closed'
                AND h.closed_at < now() - make_interval(secs => keep_seconds)
              ORDER BY h.closed_at
    LOOP
        BEGIN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)',
                           '{schema}.' || quote_ident('task_history_' || s)) INTO held;
            IF held THEN
                EXECUTE format('TRUNCATE %s', '{schema}.' || quote_ident('task_history_' || s));
            END IF;
            UPDATE {schema}.history_slots AS h SET state = 'empty', closed_at = NULL
             WHERE h.slot = s;
            emptied := emptied + 1;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- held by a reader or a late writer: the next pass
        END;
    END LOOP;
    IF now() - cur.opened_at >= slice THEN
        nxt := cur.slot % 8 + 1;
        IF (SELECT h.state FROM {schema}.history_slots AS h WHERE h.slot = nxt) = 'empty' THEN
            -- closed_at is read from the clock at the switch, after every row this slot got
            -- from a statement that read it as current before now (their finished_at is earlier).
            UPDATE {schema}.history_slots AS h SET state = 'closed', opened_at = NULL,
                   closed_at = clock_timestamp()
             WHERE h.slot = cur.slot;
            UPDATE {schema}.history_slots AS h SET state = 'current', opened_at = now()
             WHERE h.slot = nxt;
        END IF;
    END IF;
    RETURN emptied;
END;
$$;

-- cancel_tasks (schema/0010, 0022) as before, but for its answer: a task that finished into the
-- history is "finished", not "missing" (the last statement reads task_rows).
CREATE OR REPLACE FUNCTION {schema}.cancel_tasks(ids bigint[], by text DEFAULT CURRENT_USER) RETURNS TABLE(id bigint, outcome text, state text)
    LANGUAGE plpgsql
    AS $$
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
             WHERE t.id = ANY(cancel_tasks.ids) AND t.state IN ('waiting', 'scheduled', 'queued')
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
               AND (t.state IN ('waiting', 'scheduled', 'queued')
                    OR (t.state = 'in_progress' AND t.cancel_requested_at IS NULL)));
    END LOOP;
    -- Steps of workflows cancelled here: their dependents are cancelled too (schema/0021).
    PERFORM {schema}.settle_steps(ended);
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
      LEFT JOIN {schema}.task_rows AS t ON t.id = i.id
     ORDER BY i.n;
END;
$$;
