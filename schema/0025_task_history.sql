-- 0025: finished tasks leave the claim table: a history in slices, emptied a whole slice at a time.
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

-- The finished lists and counts read finished rows newest first (the console pages by
-- (finished_at, id)).
CREATE INDEX task_history_finished_idx ON {schema}.task_history (finished_at, id);

DO $$
BEGIN
    FOR s IN 1..8 LOOP
        -- Rows are written once and emptied by TRUNCATE: autovacuum only analyzes them (for
        -- the planner and the gauges' estimates); no vacuum after inserts.
        EXECUTE format('CREATE TABLE %s PARTITION OF %s FOR VALUES IN (%s) '
                       'WITH (autovacuum_vacuum_insert_threshold = -1)',
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

-- bulk_sql (schema/0008, 0016) as before, but a walk over done or cancelled rows reads the
-- history too (task_rows, in (finished_at, id) order), and a delete of them deletes from both.
CREATE OR REPLACE FUNCTION {schema}.bulk_sql(
    action  text,
    states  text[],
    filter  jsonb   DEFAULT '{}',
    cursor  jsonb   DEFAULT NULL,
    dry_run boolean DEFAULT true
) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    age        interval;
    finished   boolean;
    phase      text;
    keys       text[];
    walk_where text;
    hit_where  text := 'true';
    taken      text := 'false';
    act        text;
    listed     text;
    fence      text;
    req        text := '';
    source     text := '{schema}.tasks';
    more       text := '';
BEGIN
    age := {schema}.bulk_check(filter);
    PERFORM {schema}.bulk_states(action, states);
    IF cardinality(states) IS DISTINCT FROM 1
       AND NOT (states <@ ARRAY['done', 'cancelled'] AND cardinality(states) = 2) THEN
        RAISE EXCEPTION 'bulk: one walk is one state, or done and cancelled (see bulk_walks)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    finished := states[1] IN ('done', 'failed', 'cancelled');
    phase := {schema}.bulk_phase(states, filter, cursor);
    listed := (SELECT string_agg(quote_literal(x), ', ') FROM unnest(states) AS x);
    fence := format('t.state IN (%s)', listed);

    -- The walk's order: its index's columns. A queue in the filter is an equality on the first
    -- column of the waiting states' indexes, so the keyset starts after it. Rows without a
    -- finished_at are ordered by (finished_at, id) too, which is their id order, so that the
    -- finished states' indexes serve them (in id order alone, the planner walks the primary key).
    keys := CASE WHEN phase = 'ids' THEN ARRAY['id']
                 WHEN finished THEN ARRAY['finished_at', 'id']
                 WHEN states[1] = 'queued' THEN ARRAY['queue', '(-priority)', 'run_at', 'id']
                 ELSE ARRAY['queue', 'run_at', 'id'] END;
    IF filter ? 'queue' AND phase = 'waiting' THEN
        keys := keys[2:];
    END IF;

    IF states <@ ARRAY['done', 'cancelled'] THEN
        -- The index holds both: the walk reads its entries, the filter keeps the states asked.
        -- Done rows may have moved to the history (schema/0025): the walk reads both tables,
        -- merged in the same order (the history's (finished_at, id) index).
        source := '{schema}.task_rows';
        walk_where := 't.state IN (''done'', ''cancelled'')';
        IF cardinality(states) = 1 THEN
            hit_where := hit_where || format(' AND w.state = %L', states[1]);
        END IF;
    ELSE
        walk_where := fence;
    END IF;
    IF filter ? 'queue' AND states <@ ARRAY['done', 'cancelled'] AND phase <> 'ids' THEN
        -- tasks_done_idx has no queue: checked on the rows read, so a batch still reads at most
        -- `batch` entries however few of them are in the queue.
        hit_where := hit_where || ' AND w.queue = $2';
    ELSIF filter ? 'queue' THEN
        walk_where := walk_where || ' AND t.queue = $2';
    END IF;
    IF phase = 'ids' THEN
        walk_where := walk_where || ' AND t.id = ANY($6)';
    ELSIF phase = 'undated' THEN
        walk_where := walk_where || ' AND t.finished_at IS NULL';
    ELSIF phase = 'dated' THEN
        walk_where := walk_where || ' AND t.finished_at <= $11';
        IF age IS NOT NULL THEN
            walk_where := walk_where || ' AND t.finished_at < $11 - $5';
        END IF;
    END IF;
    IF cursor ? 'id' AND phase = 'undated' THEN
        walk_where := walk_where || ' AND t.id > $10';
    ELSIF cursor ? 'id' THEN
        walk_where := walk_where || format(' AND (%s) > (%s)',
            regexp_replace(array_to_string(keys, ', '), '([a-z_]+)', 't.\1', 'g'),
            (SELECT string_agg(CASE k WHEN 'queue' THEN '$7' WHEN '(-priority)' THEN '$8'
                                      WHEN 'id' THEN '$10' ELSE '$9' END, ', ')
               FROM unnest(keys) AS k));
    END IF;

    IF filter ? 'task' THEN
        hit_where := hit_where || ' AND w.task = $3';
    END IF;
    IF filter ? 'error' THEN
        hit_where := hit_where || ' AND w.last_error ILIKE $4';
    END IF;
    IF age IS NOT NULL AND phase <> 'dated' THEN
        hit_where := hit_where || CASE WHEN finished THEN ' AND w.finished_at < $11 - $5'
                                       ELSE ' AND w.created_at < $11 - $5' END;
    END IF;
    IF phase = 'waiting' THEN
        hit_where := hit_where || ' AND w.created_at <= $11';
    END IF;

    IF action = 'retry' THEN
        -- The one retry (requeue, above) checks the dedupe keys and, unless this is a dry run,
        -- moves the rows: the batch's matches go to it as one array.
        req := format(', req AS (SELECT r.requeued, r.skipped'
                      '            FROM {schema}.requeue(ARRAY(SELECT id FROM hit), %L) AS r)',
                      dry_run);
        taken := 'h.id = ANY((SELECT r.skipped FROM req AS r)::bigint[])';
    END IF;
    act := CASE
        WHEN dry_run THEN 'SELECT NULL::bigint AS id WHERE false'
        WHEN action = 'retry' THEN 'SELECT unnest(r.requeued) AS id FROM req AS r'
        WHEN action = 'cancel' THEN format(
            'UPDATE {schema}.tasks AS t SET state = ''cancelled'', finished_at = now()'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
        WHEN source = '{schema}.task_rows' THEN
            'SELECT id FROM acted_tasks UNION ALL SELECT id FROM acted_history'
        ELSE format(
            'DELETE FROM {schema}.tasks AS t'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
    END;
    IF act LIKE '%acted_history%' THEN
        -- A delete of done or cancelled rows: from the task table and from the history.
        more := format(
            ', acted_tasks AS ('
            '    DELETE FROM {schema}.tasks AS t'
            '     WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            '     RETURNING t.id'
            '), acted_history AS ('
            '    DELETE FROM {schema}.task_history AS t'
            '     WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            '     RETURNING t.id'
            ')', fence, fence);
    END IF;

    RETURN format(
        'WITH walk AS ('
        '    SELECT t.id, t.state, t.queue, t.priority, t.run_at, t.finished_at, t.created_at,'
        '           t.task, t.last_error, t.dedupe_key'
        '      FROM %s AS t'
        '     WHERE %s'
        '     ORDER BY %s'
        '     LIMIT $1'
        '), hit AS ('
        '    SELECT w.* FROM walk AS w WHERE %s'
        ')%s, checked AS ('
        '    SELECT h.id, %s AS taken FROM hit AS h'
        ')%s, acted AS (%s)'
        ' SELECT (SELECT count(*) FROM walk)::integer AS examined,'
        '        (SELECT count(*) FROM hit)::integer AS matched,'
        '        (SELECT count(*) FROM acted)::integer AS changed,'
        '        ARRAY(SELECT id FROM checked WHERE taken ORDER BY id) AS skipped,'
        '        ARRAY(SELECT id FROM hit ORDER BY id LIMIT 5) AS sample,'
        '        (SELECT jsonb_build_object(''phase'', %L, ''before'', $11, ''queue'', w.queue,'
        '                                   ''priority'', -w.priority, ''at'', %s, ''id'', w.id)'
        '           FROM walk AS w ORDER BY %s LIMIT 1) AS next_cursor',
        source, walk_where,
        regexp_replace(array_to_string(keys, ', '), '([a-z_]+)', 't.\1', 'g'),
        hit_where, req, taken, more, act, phase,
        CASE WHEN finished THEN 'w.finished_at' ELSE 'w.run_at' END,
        (SELECT string_agg(regexp_replace(k, '([a-z_]+)', 'w.\1') || ' DESC', ', ')
           FROM unnest(keys) AS k));
END;
$$;
