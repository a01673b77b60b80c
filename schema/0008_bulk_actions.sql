-- 0008: bulk retry, cancel and delete by filter, the record of who did what, and each task's
-- error history (issue 12).
--
-- Nothing here touches the path of a due task: the task table gains one nullable column (no
-- rewrite, nothing stored until a row fails) and no index. The bulk statements walk the indexes of
-- 0001-0007, each state by its own (see bulk_step).
--
-- The bulk logic lives here, in the database, so that `worker retry|cancel|delete` (Python calls
-- bulk_step batch after batch) and an operator in psql (CALL bulk(...)) run the same code and
-- match the same rows. Changing it needs a migration (CREATE OR REPLACE FUNCTION).
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- The errors of the last attempts, oldest first: [{"attempt", "at", "error", "worker_id"}, ...],
-- at most 10 entries of at most 2,000 characters each (the bounds are parameters of the statements
-- that append: queries/tasks.sql retry, hand_back, worker_died and rescue). NULL until the first
-- failure. last_error keeps the latest error in full (up to 4,000 characters), as before.
ALTER TABLE {schema}.tasks ADD COLUMN errors jsonb;

-- One row per bulk action (and per action of the operator console): who, when, from where, what,
-- on which rows (the filter), and how many rows it changed and left alone. `finished_at` stays NULL
-- while an action runs, and for one that was interrupted (its counts then say how far it got).
CREATE TABLE {schema}.actions (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    actor       text        NOT NULL,
    source      text        NOT NULL DEFAULT '',
    action      text        NOT NULL,
    filter      jsonb       NOT NULL DEFAULT '{}',
    counts      jsonb       NOT NULL DEFAULT '{}',
    CONSTRAINT actions_actor_length CHECK (char_length(actor) BETWEEN 1 AND 200),
    CONSTRAINT actions_source_length CHECK (char_length(source) <= 200),
    CONSTRAINT actions_action_length CHECK (char_length(action) BETWEEN 1 AND 100)
);

CREATE INDEX actions_at_idx ON {schema}.actions (at);

CREATE FUNCTION {schema}.record_action(
    actor    text,
    action   text,
    filter   jsonb   DEFAULT '{}',
    counts   jsonb   DEFAULT '{}',
    source   text    DEFAULT '',
    finished boolean DEFAULT true
) RETURNS bigint
LANGUAGE sql AS $$
    INSERT INTO {schema}.actions (actor, action, filter, counts, source, finished_at)
    VALUES (left(coalesce(nullif(actor, ''), session_user::text), 200), left(action, 100),
            coalesce(filter, '{}'), coalesce(counts, '{}'), left(coalesce(source, ''), 200),
            CASE WHEN finished THEN now() END)
    RETURNING id;
$$;

CREATE FUNCTION {schema}.finish_action(action_id bigint, counts jsonb, finished boolean DEFAULT true)
RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.actions
       SET counts = coalesce(finish_action.counts, '{}'),
           finished_at = CASE WHEN finish_action.finished THEN now() END
     WHERE id = finish_action.action_id;
$$;

-- The states an action applies to, and those it walks when the filter names none:
--   retry:  failed, cancelled -> queued (default: failed)
--   cancel: scheduled, queued -> cancelled (default: both); a running task is never touched
--   delete: done, failed, cancelled, scheduled, queued (default: the finished three); never a
--           running task
-- `states` NULL or empty: the default. A state the action does not apply to raises.
CREATE FUNCTION {schema}.bulk_states(action text, states text[] DEFAULT NULL) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    allowed  text[];
    defaults text[];
BEGIN
    CASE action
        WHEN 'retry' THEN
            allowed := ARRAY['failed', 'cancelled'];
            defaults := ARRAY['failed'];
        WHEN 'cancel' THEN
            allowed := ARRAY['scheduled', 'queued'];
            defaults := allowed;
        WHEN 'delete' THEN
            allowed := ARRAY['done', 'failed', 'cancelled', 'scheduled', 'queued'];
            defaults := ARRAY['done', 'failed', 'cancelled'];
        ELSE
            RAISE EXCEPTION 'bulk: unknown action %', quote_literal(coalesce(action, 'NULL'))
                USING ERRCODE = 'invalid_parameter_value', HINT = 'retry, cancel or delete';
    END CASE;
    IF states IS NULL OR cardinality(states) = 0 THEN
        RETURN defaults;
    END IF;
    IF NOT states <@ allowed OR array_position(states, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'bulk: % applies to % tasks, not %', action,
            array_to_string(allowed, ', '), array_to_string(states, ', ', 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN ARRAY(SELECT s FROM unnest(allowed) AS s WHERE s = ANY(states));
END;
$$;

-- A filter: a JSON object with any of
--   "queue": "mail"             the queue, exactly
--   "task": "send_email"        the task name, exactly
--   "states": ["failed"]        (or one string) see bulk_states
--   "error": "Timeout%"         last_error ILIKE this pattern: the whole error, case-insensitive,
--                               % any text, _ one character, \ escapes the next (\%, \_, \\)
--   "older_than": 3600          seconds, or an interval as text ("7 days"): finished that long
--                               ago for done, failed and cancelled tasks; created that long ago for
--                               scheduled and queued ones
--   "ids": [1, 2, 3]            these tasks only (at most 100,000 ids)
-- Anything else raises, so that a misspelt key cannot widen an action to every row. Returns the
-- filter's age as an interval (NULL without "older_than").
CREATE FUNCTION {schema}.bulk_check(filter jsonb) RETURNS interval
LANGUAGE plpgsql STABLE AS $$
DECLARE
    k   text;
    age interval;
BEGIN
    IF filter IS NULL OR jsonb_typeof(filter) <> 'object' THEN
        RAISE EXCEPTION 'bulk: the filter must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR k IN SELECT jsonb_object_keys(filter) LOOP
        IF k NOT IN ('queue', 'task', 'states', 'error', 'older_than', 'ids') THEN
            RAISE EXCEPTION 'bulk: unknown filter key %', quote_literal(k)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'queue, task, states, error, older_than, ids';
        END IF;
    END LOOP;
    FOREACH k IN ARRAY ARRAY['queue', 'task', 'error'] LOOP
        IF filter ? k AND jsonb_typeof(filter -> k) <> 'string' THEN
            RAISE EXCEPTION 'bulk: filter key % must be a string', k
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF filter ? 'states' AND jsonb_typeof(filter -> 'states') NOT IN ('string', 'array') THEN
        RAISE EXCEPTION 'bulk: "states" must be a string or an array of strings'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF filter ? 'ids' THEN
        IF jsonb_typeof(filter -> 'ids') <> 'array' THEN
            RAISE EXCEPTION 'bulk: "ids" must be an array of task ids'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_array_length(filter -> 'ids') > 100000 THEN
            RAISE EXCEPTION 'bulk: at most 100000 ids' USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    IF filter ? 'older_than' THEN
        CASE jsonb_typeof(filter -> 'older_than')
            WHEN 'number' THEN age := make_interval(secs => (filter ->> 'older_than')::float8);
            WHEN 'string' THEN age := (filter ->> 'older_than')::interval;
            ELSE RAISE EXCEPTION 'bulk: "older_than" must be seconds or an interval'
                     USING ERRCODE = 'invalid_parameter_value';
        END CASE;
        IF age < interval '0' THEN
            RAISE EXCEPTION 'bulk: "older_than" must not be negative'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    RETURN age;
END;
$$;

-- The states a filter names ("states": one string or an array), NULL when it names none.
CREATE FUNCTION {schema}.bulk_filter_states(filter jsonb) RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE jsonb_typeof(filter -> 'states')
               WHEN 'string' THEN ARRAY[filter ->> 'states']
               WHEN 'array' THEN ARRAY(SELECT jsonb_array_elements_text(filter -> 'states'))
           END;
$$;

-- The walks of an action's states, each an array of the states one index holds: done and
-- cancelled share tasks_done_idx, so they are walked together (apart, each walk would read the
-- other's entries too); every other state is a walk of its own. In the order of `states`.
CREATE FUNCTION {schema}.bulk_walks(states text[]) RETURNS SETOF text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN s IN ('done', 'cancelled')
                THEN ARRAY(SELECT x FROM unnest(states) AS x WHERE x IN ('done', 'cancelled'))
                ELSE ARRAY[s] END
      FROM unnest(states) WITH ORDINALITY AS u(s, i)
     WHERE s NOT IN ('done', 'cancelled')
        OR i = (SELECT min(j) FROM unnest(states) WITH ORDINALITY AS v(x, j)
                 WHERE x IN ('done', 'cancelled'))
     ORDER BY i;
$$;

-- Which part of a walk a batch continues: 'ids' (the filter lists ids), 'dated' then 'undated'
-- (finished states: rows with a finished_at, then those without), or 'waiting' (scheduled,
-- queued).
CREATE FUNCTION {schema}.bulk_phase(states text[], filter jsonb, cursor jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(cursor ->> 'phase',
                    CASE WHEN filter ? 'ids' THEN 'ids'
                         WHEN states[1] IN ('done', 'failed', 'cancelled') THEN 'dated'
                         ELSE 'waiting' END);
$$;

-- One batch of a bulk action over the tasks of one walk (`states`: one state, or done and
-- cancelled, see bulk_walks): reads at most `batch` entries of the walk's index, in its order, from
-- where the previous batch stopped (`cursor`: NULL to start), acts on the rows that match the rest
-- of the filter, and says where to go on (`next_cursor`: NULL when the walk is done). Each call is one statement, so each batch commits on its own and none holds
-- more than `batch` row locks; the work of one call is bounded by `batch` however few rows match.
--
-- The walks, each on an index of 0001-0007 (a queue in the filter narrows the first four):
--   failed              (finished_at, id), tasks_failed_idx or tasks_failed_queue_idx
--   done, cancelled     (finished_at, id), tasks_done_idx, both states in one walk (a walk of
--                       one of them reads the other's entries and leaves them)
--   queued              (queue, -priority, run_at, id), tasks_claim_idx
--   scheduled           (queue, run_at, id), tasks_scheduled_queue_idx
--   with "ids"          id, the primary key
-- Finished rows without a finished_at (set by hand) are walked after the others, by id, unless
-- the filter has an age. A queue (but for done and cancelled) and "older_than" on a finished
-- state bound the walk itself; the rest of the filter is checked on the rows read, so that one
-- batch never reads more than `batch` entries, however few of them match.
--
-- Only rows that were in the state when the action's first batch ran are taken: a task retried by
-- this action that fails again meanwhile is not retried twice (the first call fixes `before` and
-- the cursor carries it).
--
-- dry_run: count, change nothing. Otherwise:
--   retry:  -> queued, due now, attempts 0, like `worker retry --failed`. A task whose dedupe key
--           a scheduled, queued or running task holds (or an older one of the same batch takes)
--           stays as it is and is returned in `skipped`. Idle workers are woken.
--   cancel: -> cancelled, finished now.
--   delete: deleted.
-- Every change is fenced on the state: a row that left it meanwhile (a worker claimed it) is left
-- alone, and counted in `matched` but not in `changed`.
--
-- bulk_sql builds the statement of one batch (so that tests can EXPLAIN it); bulk_step runs it.
-- Its parameters: $1 batch integer, $2 queue text, $3 task text, $4 error text, $5 age interval,
-- $6 ids bigint[], $7 cursor queue text, $8 cursor -priority integer, $9 cursor finished_at or
-- run_at timestamptz, $10 cursor id bigint, $11 before timestamptz. The states are literals (the
-- names above, checked first), so the planner can match partial indexes; every value the filter
-- holds is a bound parameter, never text of the statement.
CREATE FUNCTION {schema}.bulk_sql(
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
        taken := 'h.dedupe_key IS NOT NULL'
            ' AND (row_number() OVER (PARTITION BY h.dedupe_key ORDER BY h.id) > 1'
            '      OR EXISTS (SELECT 1 FROM {schema}.tasks AS d'
            '                  WHERE d.dedupe_key = h.dedupe_key'
            '                    AND d.state IN (''scheduled'', ''queued'', ''in_progress'')))';
    END IF;
    -- A retried task starts afresh: a cancel request from an earlier run must not follow it
    -- (those two columns come with schema/0010; this text runs only once every migration is in).
    act := CASE
        WHEN dry_run THEN 'SELECT NULL::bigint AS id WHERE false'
        WHEN action = 'retry' THEN format(
            'UPDATE {schema}.tasks AS t'
            '   SET state = ''queued'', run_at = now(), attempts = 0, finished_at = NULL,'
            '       lease_expires_at = NULL, cancel_requested_at = NULL, cancelled_by = NULL'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
        WHEN action = 'cancel' THEN format(
            'UPDATE {schema}.tasks AS t SET state = ''cancelled'', finished_at = now()'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
        ELSE format(
            'DELETE FROM {schema}.tasks AS t'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
    END;

    RETURN format(
        'WITH walk AS ('
        '    SELECT t.id, t.state, t.queue, t.priority, t.run_at, t.finished_at, t.created_at,'
        '           t.task, t.last_error, t.dedupe_key'
        '      FROM {schema}.tasks AS t'
        '     WHERE %s'
        '     ORDER BY %s'
        '     LIMIT $1'
        '), hit AS ('
        '    SELECT w.* FROM walk AS w WHERE %s'
        '), checked AS ('
        '    SELECT h.id, %s AS taken FROM hit AS h'
        '), acted AS (%s)'
        ' SELECT (SELECT count(*) FROM walk)::integer AS examined,'
        '        (SELECT count(*) FROM hit)::integer AS matched,'
        '        (SELECT count(*) FROM acted)::integer AS changed,'
        '        ARRAY(SELECT id FROM checked WHERE taken ORDER BY id) AS skipped,'
        '        ARRAY(SELECT id FROM hit ORDER BY id LIMIT 5) AS sample,'
        '        (SELECT jsonb_build_object(''phase'', %L, ''before'', $11, ''queue'', w.queue,'
        '                                   ''priority'', -w.priority, ''at'', %s, ''id'', w.id)'
        '           FROM walk AS w ORDER BY %s LIMIT 1) AS next_cursor',
        walk_where,
        regexp_replace(array_to_string(keys, ', '), '([a-z_]+)', 't.\1', 'g'),
        hit_where, taken, act, phase,
        CASE WHEN finished THEN 'w.finished_at' ELSE 'w.run_at' END,
        (SELECT string_agg(regexp_replace(k, '([a-z_]+)', 'w.\1') || ' DESC', ', ')
           FROM unnest(keys) AS k));
END;
$$;

CREATE FUNCTION {schema}.bulk_step(
    action  text,
    states  text[],
    filter  jsonb   DEFAULT '{}',
    cursor  jsonb   DEFAULT NULL,
    batch   integer DEFAULT 5000,
    dry_run boolean DEFAULT true
) RETURNS TABLE (examined integer, matched integer, changed integer, skipped bigint[],
                 sample bigint[], next_cursor jsonb)
-- A batch runs in milliseconds; JIT would compile its statement first, which alone takes longer.
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    stmt   text;
    age    interval;
    ids    bigint[];
    phase  text;
    before timestamptz;
    tries  integer := 0;
BEGIN
    IF batch IS NULL OR batch NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'bulk: batch must be 1 to 100000' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    stmt := {schema}.bulk_sql(action, states, filter, cursor, dry_run);  -- checks them all
    age := {schema}.bulk_check(filter);
    IF filter ? 'ids' THEN
        ids := ARRAY(SELECT jsonb_array_elements_text(filter -> 'ids')::bigint);
    END IF;
    phase := {schema}.bulk_phase(states, filter, cursor);
    before := coalesce((cursor ->> 'before')::timestamptz, now());
    LOOP
        BEGIN
            EXECUTE stmt INTO examined, matched, changed, skipped, sample, next_cursor
                USING batch, filter ->> 'queue', filter ->> 'task', filter ->> 'error', age, ids,
                      cursor ->> 'queue', (cursor ->> 'priority')::integer,
                      (cursor ->> 'at')::timestamptz, (cursor ->> 'id')::bigint, before;
            EXIT;
        EXCEPTION WHEN unique_violation THEN
            -- A producer took a dedupe key between the check and the update: the batch runs again
            -- and then sees that task.
            tries := tries + 1;
            IF tries >= 3 THEN
                RAISE;
            END IF;
        END;
    END LOOP;

    IF examined < batch THEN
        -- This walk is done; finished rows without a finished_at come last (never older than
        -- an age, so not with one).
        next_cursor := CASE WHEN phase = 'dated' AND age IS NULL
                            THEN jsonb_build_object('phase', 'undated', 'before', before) END;
    END IF;
    IF action = 'retry' AND changed > 0 THEN
        PERFORM pg_notify(array_to_string(parse_ident('{schema}.tasks'), '.'), '');
    END IF;
    RETURN NEXT;
END;
$$;

-- Running tasks that match a filter's queue, task, error, creation age and ids (up to `cap`), with
-- the first few ids: what a bulk cancel or delete leaves alone. Running rows are few (at most the
-- workers' slots), read from tasks_lease_idx.
CREATE FUNCTION {schema}.bulk_running(filter jsonb DEFAULT '{}', cap integer DEFAULT 100000)
RETURNS TABLE (running bigint, sample bigint[])
LANGUAGE plpgsql STABLE SET jit = off AS $$
DECLARE
    age interval;
BEGIN
    age := {schema}.bulk_check(filter);
    RETURN QUERY
    SELECT count(*), (array_agg(r.id ORDER BY r.id))[1:5]
      FROM (SELECT t.id
              FROM {schema}.tasks AS t
             WHERE t.state = 'in_progress'
               AND (NOT filter ? 'queue' OR t.queue = filter ->> 'queue')
               AND (NOT filter ? 'task' OR t.task = filter ->> 'task')
               AND (NOT filter ? 'error' OR t.last_error ILIKE filter ->> 'error')
               AND (age IS NULL OR t.created_at < now() - age)
               AND (NOT filter ? 'ids'
                    OR t.id = ANY(ARRAY(SELECT jsonb_array_elements_text(filter -> 'ids')::bigint)))
             LIMIT cap) AS r;
END;
$$;

-- Bulk actions from psql. A dry run unless dry_run => false: it then commits after each batch (so
-- CALL it outside BEGIN ... COMMIT) and records the action in `actions`, by `actor` (default: the
-- session's user). Examples:
--   CALL worker.bulk('retry', '{"queue": "mail", "error": "Timeout%", "older_than": "1 hour"}');
--   CALL worker.bulk('delete', '{"states": ["done"], "older_than": "7 days"}', dry_run => false);
-- A filter with no key at all is refused: say which rows ("states" alone is enough).
CREATE PROCEDURE {schema}.bulk(
    action    text,
    filter    jsonb   DEFAULT '{}',
    dry_run   boolean DEFAULT true,
    actor     text    DEFAULT NULL,
    batch     integer DEFAULT 5000,
    INOUT matched   bigint DEFAULT NULL,
    INOUT changed   bigint DEFAULT NULL,
    INOUT skipped   bigint DEFAULT NULL,
    INOUT running   bigint DEFAULT NULL,
    INOUT action_id bigint DEFAULT NULL
)
LANGUAGE plpgsql AS $$
DECLARE
    states   text[];
    walks    jsonb;
    walk     text[];
    cur      jsonb;
    r        record;
    leftover bigint := 0;
    batches  integer := 0;
BEGIN
    PERFORM {schema}.bulk_check(filter);
    IF filter = '{}' THEN
        RAISE EXCEPTION 'bulk: give a filter (queue, task, states, error, older_than or ids)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    states := {schema}.bulk_states(action, {schema}.bulk_filter_states(filter));
    matched := 0;
    changed := 0;
    skipped := 0;
    running := 0;
    IF NOT dry_run THEN
        action_id := {schema}.record_action(actor, action, filter, '{}', 'sql', false);
        COMMIT;
    END IF;
    walks := (SELECT jsonb_agg(to_jsonb(w)) FROM {schema}.bulk_walks(states) AS w);
    FOR i IN 0 .. jsonb_array_length(walks) - 1 LOOP
        walk := ARRAY(SELECT jsonb_array_elements_text(walks -> i));
        cur := NULL;
        LOOP
            SELECT * INTO r FROM {schema}.bulk_step(action, walk, filter, cur, batch, dry_run);
            matched := matched + r.matched;
            changed := changed + r.changed;
            skipped := skipped + cardinality(r.skipped);
            batches := batches + 1;
            IF NOT dry_run THEN
                PERFORM {schema}.finish_action(action_id, jsonb_build_object(
                    'matched', matched, 'changed', changed, 'batches', batches,
                    'skipped', jsonb_build_object('dedupe_key_taken', skipped)), false);
                COMMIT;
            END IF;
            EXIT WHEN r.next_cursor IS NULL;
            cur := r.next_cursor;
        END LOOP;
    END LOOP;
    IF action = 'cancel' OR states && ARRAY['scheduled', 'queued'] THEN
        SELECT b.running INTO running FROM {schema}.bulk_running(filter) AS b;
    END IF;
    leftover := matched - changed - skipped;
    IF NOT dry_run THEN
        PERFORM {schema}.finish_action(action_id, jsonb_build_object(
            'matched', matched, 'changed', changed, 'batches', batches,
            'skipped', jsonb_build_object('dedupe_key_taken', skipped, 'running', running,
                                          'changed_meanwhile', leftover)));
        COMMIT;
    END IF;
END;
$$;
