-- The schema as the migrations in this folder build it, for reading: `worker migrate` applies
-- the numbered files, never this one. Made by pg_dump --schema-only from a database migrated to
-- the latest version (tests/test_schema_snapshot.py checks that it is current).

-- Name: worker; Type: SCHEMA; Schema: -; Owner: -

CREATE SCHEMA worker;

-- Name: task_state; Type: TYPE; Schema: worker; Owner: -

CREATE TYPE worker.task_state AS ENUM (
    'waiting',
    'scheduled',
    'queued',
    'in_progress',
    'done',
    'failed',
    'cancelled'
);

-- Name: before_insert(); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.before_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF NEW.queue IS NULL THEN
        NEW.queue := coalesce(
            (SELECT r.queue FROM "worker".task_routes AS r WHERE r.task = NEW.task), 'default');
    END IF;
    IF NEW.state = 'queued' AND NEW.run_at > now() THEN
        NEW.state := 'scheduled';
    END IF;
    RETURN NEW;
END;
$$;

-- Name: bulk(text, jsonb, boolean, text, integer, bigint, bigint, bigint, bigint, bigint); Type: PROCEDURE; Schema: worker; Owner: -

CREATE PROCEDURE worker.bulk(IN action text, IN filter jsonb DEFAULT '{}'::jsonb, IN dry_run boolean DEFAULT true, IN actor text DEFAULT NULL::text, IN batch integer DEFAULT 5000, INOUT matched bigint DEFAULT NULL::bigint, INOUT changed bigint DEFAULT NULL::bigint, INOUT skipped bigint DEFAULT NULL::bigint, INOUT running bigint DEFAULT NULL::bigint, INOUT action_id bigint DEFAULT NULL::bigint)
    LANGUAGE plpgsql
    AS $$
DECLARE
    states   text[];
    walks    jsonb;
    walk     text[];
    cur      jsonb;
    r        record;
    leftover bigint := 0;
    batches  integer := 0;
BEGIN
    PERFORM "worker".bulk_check(filter);
    IF filter = '{}' THEN
        RAISE EXCEPTION 'bulk: give a filter (queue, task, states, error, older_than or ids)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    states := "worker".bulk_states(action, "worker".bulk_filter_states(filter));
    matched := 0;
    changed := 0;
    skipped := 0;
    running := 0;
    IF NOT dry_run THEN
        action_id := "worker".record_action(actor, action, filter, '{}', 'sql', false);
        COMMIT;
    END IF;
    walks := (SELECT jsonb_agg(to_jsonb(w)) FROM "worker".bulk_walks(states) AS w);
    FOR i IN 0 .. jsonb_array_length(walks) - 1 LOOP
        walk := ARRAY(SELECT jsonb_array_elements_text(walks -> i));
        cur := NULL;
        LOOP
            SELECT * INTO r FROM "worker".bulk_step(action, walk, filter, cur, batch, dry_run);
            matched := matched + r.matched;
            changed := changed + r.changed;
            skipped := skipped + cardinality(r.skipped);
            batches := batches + 1;
            IF NOT dry_run THEN
                PERFORM "worker".finish_action(action_id, jsonb_build_object(
                    'matched', matched, 'changed', changed, 'batches', batches,
                    'skipped', jsonb_build_object('dedupe_key_taken', skipped)), false);
                COMMIT;
            END IF;
            EXIT WHEN r.next_cursor IS NULL;
            cur := r.next_cursor;
        END LOOP;
    END LOOP;
    IF action = 'cancel' OR states && ARRAY['scheduled', 'queued'] THEN
        SELECT b.running INTO running FROM "worker".bulk_running(filter) AS b;
    END IF;
    leftover := matched - changed - skipped;
    IF NOT dry_run THEN
        PERFORM "worker".finish_action(action_id, jsonb_build_object(
            'matched', matched, 'changed', changed, 'batches', batches,
            'skipped', jsonb_build_object('dedupe_key_taken', skipped, 'running', running,
                                          'changed_meanwhile', leftover)));
        COMMIT;
    END IF;
END;
$$;

-- Name: bulk_check(jsonb); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_check(filter jsonb) RETURNS interval
    LANGUAGE plpgsql STABLE
    AS $$
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

-- Name: bulk_filter_states(jsonb); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_filter_states(filter jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE jsonb_typeof(filter -> 'states')
               WHEN 'string' THEN ARRAY[filter ->> 'states']
               WHEN 'array' THEN ARRAY(SELECT jsonb_array_elements_text(filter -> 'states'))
           END;
$$;

-- Name: bulk_phase(text[], jsonb, jsonb); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_phase(states text[], filter jsonb, cursor jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT coalesce(cursor ->> 'phase',
                    CASE WHEN filter ? 'ids' THEN 'ids'
                         WHEN states[1] IN ('done', 'failed', 'cancelled') THEN 'dated'
                         ELSE 'waiting' END);
$$;

-- Name: bulk_running(jsonb, integer); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_running(filter jsonb DEFAULT '{}'::jsonb, cap integer DEFAULT 100000) RETURNS TABLE(running bigint, sample bigint[])
    LANGUAGE plpgsql STABLE
    SET jit TO 'off'
    AS $$
DECLARE
    age interval;
BEGIN
    age := "worker".bulk_check(filter);
    RETURN QUERY
    SELECT count(*), (array_agg(r.id ORDER BY r.id))[1:5]
      FROM (SELECT t.id
              FROM "worker".tasks AS t
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

-- Name: bulk_sql(text, text[], jsonb, jsonb, boolean); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_sql(action text, states text[], filter jsonb DEFAULT '{}'::jsonb, cursor jsonb DEFAULT NULL::jsonb, dry_run boolean DEFAULT true) RETURNS text
    LANGUAGE plpgsql STABLE
    AS $_$
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
    source     text := '"worker".tasks';
    more       text := '';
BEGIN
    age := "worker".bulk_check(filter);
    PERFORM "worker".bulk_states(action, states);
    IF cardinality(states) IS DISTINCT FROM 1
       AND NOT (states <@ ARRAY['done', 'cancelled'] AND cardinality(states) = 2) THEN
        RAISE EXCEPTION 'bulk: one walk is one state, or done and cancelled (see bulk_walks)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    finished := states[1] IN ('done', 'failed', 'cancelled');
    phase := "worker".bulk_phase(states, filter, cursor);
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
        source := '"worker".task_rows';
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
                      '            FROM "worker".requeue(ARRAY(SELECT id FROM hit), %L) AS r)',
                      dry_run);
        taken := 'h.id = ANY((SELECT r.skipped FROM req AS r)::bigint[])';
    END IF;
    act := CASE
        WHEN dry_run THEN 'SELECT NULL::bigint AS id WHERE false'
        WHEN action = 'retry' THEN 'SELECT unnest(r.requeued) AS id FROM req AS r'
        WHEN action = 'cancel' THEN format(
            'UPDATE "worker".tasks AS t SET state = ''cancelled'', finished_at = now()'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
        WHEN source = '"worker".task_rows' THEN
            'SELECT id FROM acted_tasks UNION ALL SELECT id FROM acted_history'
        ELSE format(
            'DELETE FROM "worker".tasks AS t'
            ' WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            ' RETURNING t.id', fence)
    END;
    IF act LIKE '%acted_history%' THEN
        -- A delete of done or cancelled rows: from the task table and from the history.
        more := format(
            ', acted_tasks AS ('
            '    DELETE FROM "worker".tasks AS t'
            '     WHERE t.id = ANY(ARRAY(SELECT id FROM checked WHERE NOT taken)) AND %s'
            '     RETURNING t.id'
            '), acted_history AS ('
            '    DELETE FROM "worker".task_history AS t'
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
$_$;

-- Name: bulk_states(text, text[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_states(action text, states text[] DEFAULT NULL::text[]) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE
    AS $$
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

-- Name: bulk_step(text, text[], jsonb, jsonb, integer, boolean); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_step(action text, states text[], filter jsonb DEFAULT '{}'::jsonb, cursor jsonb DEFAULT NULL::jsonb, batch integer DEFAULT 5000, dry_run boolean DEFAULT true) RETURNS TABLE(examined integer, matched integer, changed integer, skipped bigint[], sample bigint[], next_cursor jsonb)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
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
    stmt := "worker".bulk_sql(action, states, filter, cursor, dry_run);  -- checks them all
    age := "worker".bulk_check(filter);
    IF filter ? 'ids' THEN
        ids := ARRAY(SELECT jsonb_array_elements_text(filter -> 'ids')::bigint);
    END IF;
    phase := "worker".bulk_phase(states, filter, cursor);
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
        PERFORM pg_notify(array_to_string(parse_ident('"worker".tasks'), '.'), '');
    END IF;
    IF action = 'cancel' AND changed > 0 AND NOT dry_run THEN
        -- Workflow steps this batch cancelled: the steps that wait for them are cancelled too,
        -- in this transaction, as cancel_tasks does (their finished_at is this transaction's).
        PERFORM "worker".settle_steps(ARRAY(
            SELECT t.id FROM "worker".tasks AS t
             WHERE t.dependents AND t.state IN ('done', 'failed', 'cancelled')
               AND t.state = 'cancelled' AND t.finished_at = now()));
    END IF;
    RETURN NEXT;
END;
$$;

-- Name: bulk_walks(text[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.bulk_walks(states text[]) RETURNS SETOF text[]
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE WHEN s IN ('done', 'cancelled')
                THEN ARRAY(SELECT x FROM unnest(states) AS x WHERE x IN ('done', 'cancelled'))
                ELSE ARRAY[s] END
      FROM unnest(states) WITH ORDINALITY AS u(s, i)
     WHERE s NOT IN ('done', 'cancelled')
        OR i = (SELECT min(j) FROM unnest(states) WITH ORDINALITY AS v(x, j)
                 WHERE x IN ('done', 'cancelled'))
     ORDER BY i;
$$;

-- Name: cancel_task(bigint, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.cancel_task(id bigint, by text DEFAULT CURRENT_USER) RETURNS text
    LANGUAGE sql
    AS $$
    SELECT c.outcome FROM "worker".cancel_tasks(ARRAY[cancel_task.id], cancel_task.by) AS c;
$$;

-- Name: cancel_tasks(bigint[], text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.cancel_tasks(ids bigint[], by text DEFAULT CURRENT_USER) RETURNS TABLE(id bigint, outcome text, state text)
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
            UPDATE "worker".tasks AS t
               SET state = 'cancelled', finished_at = now(),
                   cancel_requested_at = now(), cancelled_by = who
             WHERE t.id = ANY(cancel_tasks.ids) AND t.state IN ('waiting', 'scheduled', 'queued')
            RETURNING t.id
        )
        SELECT coalesce(array_agg(moved.id), '{}') INTO got FROM moved;
        ended := ended || got;
        -- Running: marked for its worker.
        WITH marked AS (
            UPDATE "worker".tasks AS t
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
            SELECT 1 FROM "worker".tasks AS t
             WHERE t.id = ANY(cancel_tasks.ids)
               AND (t.state IN ('waiting', 'scheduled', 'queued')
                    OR (t.state = 'in_progress' AND t.cancel_requested_at IS NULL)));
    END LOOP;
    -- Steps of workflows cancelled here: their dependents are cancelled too (schema/0021).
    PERFORM "worker".settle_steps(ended);
    IF cardinality(asked) > 0 THEN
        -- The channel carries the schema's own name (as the insert trigger's does); the payload
        -- lists the ids, or is empty when they would not fit ("check every task you hold").
        SELECT n.nspname || '.tasks_cancel' INTO channel
          FROM pg_catalog.pg_class AS c
          JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
         WHERE c.oid = '"worker".tasks'::regclass;
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
      LEFT JOIN "worker".task_rows AS t ON t.id = i.id
     ORDER BY i.n;
END;
$$;

-- Name: cancel_workflow(bigint, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.cancel_workflow(workflow_id bigint, by text DEFAULT CURRENT_USER) RETURNS integer
    LANGUAGE sql
    AS $$
    SELECT count(*)::integer
      FROM "worker".cancel_tasks(
               ARRAY(SELECT t.id FROM "worker".tasks AS t
                      WHERE t.workflow_id = cancel_workflow.workflow_id
                        AND t.state IN ('waiting', 'scheduled', 'queued', 'in_progress')
                      ORDER BY t.id),
               cancel_workflow.by) AS c
     WHERE c.outcome IN ('cancelled', 'requested');
$$;

-- Name: claim_limited_batch(text[], integer, double precision, text, timestamp with time zone, timestamp with time zone, double precision, integer, integer, double precision, timestamp with time zone); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.claim_limited_batch(queues text[], want integer, lookahead double precision DEFAULT 0.5, pace_queue text DEFAULT NULL::text, pace_t0 timestamp with time zone DEFAULT NULL::timestamp with time zone, pace_m timestamp with time zone DEFAULT NULL::timestamp with time zone, pace_gap double precision DEFAULT NULL::double precision, pace_burst integer DEFAULT NULL::integer, pace_n integer DEFAULT NULL::integer, pace_wait double precision DEFAULT NULL::double precision, pace_end timestamp with time zone DEFAULT NULL::timestamp with time zone) RETURNS TABLE(id bigint, start_at timestamp with time zone, queue text, wait_seconds double precision, held boolean)
    LANGUAGE plpgsql
    AS $$
DECLARE
    q     text;
    holds boolean;
    rest  integer := want;
    r     record;
    paced boolean := false;
BEGIN
    IF want > 0 AND cardinality(queues) > 0 THEN
        FOR q, holds IN
                 SELECT l.queue, l.concurrency IS NOT NULL OR l.key_concurrency IS NOT NULL
                   FROM "worker".queue_limits AS l
                  WHERE l.queue = ANY(queues)
                    AND NOT EXISTS (SELECT 1 FROM "worker".paused_queues AS p
                                     WHERE p.queue = l.queue)
                  ORDER BY l.queue
        LOOP
            EXIT WHEN rest <= 0;
            IF q = pace_queue THEN
                paced := true;
                SELECT * INTO r FROM "worker".claim_limited_rows(
                    q, rest, lookahead, pace_t0, pace_m, pace_gap, pace_burst, pace_n, pace_wait,
                    pace_end);
            ELSE
                SELECT * INTO r FROM "worker".claim_limited_rows(q, rest, lookahead);
            END IF;
            RETURN QUERY SELECT x.id, x.s, q, NULL::double precision,
                                CASE WHEN holds THEN true END
                           FROM unnest(r.ids, r.start_at) AS x(id, s);
            rest := rest - cardinality(r.ids);
            IF r.held OR r.wait_seconds IS NOT NULL THEN
                RETURN QUERY SELECT NULL::bigint, NULL::timestamptz, q, r.wait_seconds, r.held;
            END IF;
        END LOOP;
    END IF;
    IF NOT paced AND pace_n > 0 THEN
        -- The queue paced ahead was not reached (the batch filled first, or it was paused):
        -- its starts go back.
        PERFORM "worker".give_back_pace(pace_queue, pace_m, make_interval(secs => pace_gap), 0,
                                        pace_end);
    END IF;
END;
$$;

-- Name: claim_limited_rows(text, integer, double precision, timestamp with time zone, timestamp with time zone, double precision, integer, integer, double precision, timestamp with time zone); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.claim_limited_rows(q text, want integer, lookahead double precision DEFAULT 0.5, pace_t0 timestamp with time zone DEFAULT NULL::timestamp with time zone, pace_m timestamp with time zone DEFAULT NULL::timestamp with time zone, pace_gap double precision DEFAULT NULL::double precision, pace_burst integer DEFAULT NULL::integer, pace_n integer DEFAULT NULL::integer, pace_wait double precision DEFAULT NULL::double precision, pace_end timestamp with time zone DEFAULT NULL::timestamp with time zone, OUT ids bigint[], OUT start_at timestamp with time zone[], OUT wait_seconds double precision, OUT held boolean) RETURNS record
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_hashjoin TO 'off'
    SET enable_mergejoin TO 'off'
    AS $$
#variable_conflict use_variable
DECLARE
    lim      "worker".queue_limits;
    -- The database clock now (not the transaction's start): the pace is counted from it.
    t0       timestamptz := clock_timestamp();
    room     integer := want;
    permits  integer[] := '{}';
    used     integer[];
    take     integer;
    fit      integer;
    m        timestamptz;
    atts     integer[] := '{}';
    keyed    boolean;
    gap      interval;
    key_gap  interval;
    tat      timestamptz;
    horizon  timestamptz;
    cand     record;
    kbusy    text[] := '{}';
    s        timestamptz;
    rowslots integer[] := '{}';
    rowkeys  text[] := '{}';
    kslot    integer;
    pt0      timestamptz;
    burst    integer;
    pend     timestamptz;
    lo       integer;
    pos      integer[];
    ix       integer;
BEGIN
    ids := '{}';
    start_at := '{}';
    held := false;
    SELECT * INTO lim FROM "worker".queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR want <= 0 THEN
        RETURN;
    END IF;
    horizon := t0 + make_interval(secs => lookahead);

    IF lim.concurrency IS NOT NULL THEN
        -- Free permits, lowest slots first: never held, or held by an attempt that no longer
        -- runs under a live lease. Nothing gives a permit back: the attempt's end does.
        -- A permit another claim took after this statement's snapshot comes to the lock in its
        -- new version, with its holder's row as the snapshot has it (not yet running): the view
        -- counts it as held (taken_by, see free_permits), so no second look is needed.
        permits := ARRAY(
            SELECT p.slot FROM "worker".free_permits AS p
             WHERE p.queue = q AND p.limit_key = '' AND p.slot <= lim.concurrency
             ORDER BY p.slot LIMIT room
               FOR UPDATE SKIP LOCKED);
        -- Rows running under the limit that hold no permit (written by hand, or from before
        -- permits) count too: never more running than the limit, whatever the permits say.
        room := least(cardinality(permits), lim.concurrency - (
            SELECT count(*) FROM "worker".tasks AS t
             WHERE t.queue = q AND t.state = 'in_progress' AND t.limit_held
               AND t.lease_expires_at >= t0));
        IF room < want THEN
            held := true;
        END IF;
        room := greatest(room, 0);
    END IF;

    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate IS NOT NULL;
    IF lim.rate IS NOT NULL AND NOT keyed AND pace_n IS NOT NULL THEN
        -- The pace was taken ahead, in a transaction of its own (pace_ahead): the starts it
        -- allows are this claim's, and what it does not use goes back below.
        pt0 := pace_t0;
        m := pace_m;
        gap := make_interval(secs => pace_gap);
        burst := pace_burst;
        fit := pace_n;
        pend := pace_end;
        wait_seconds := pace_wait;
    ELSIF lim.rate IS NOT NULL AND NOT keyed AND room > 0 THEN
        SELECT p.t0, p.m, make_interval(secs => p.gap_seconds), p.burst, p.n, p.wait_seconds,
               p.tat_end
          INTO pt0, m, gap, burst, fit, wait_seconds, pend
          FROM "worker".take_starts(q, room, lookahead) AS p;
    ELSIF lim.rate IS NOT NULL AND room > 0 THEN
        gap := make_interval(secs => lim.rate_seconds / lim.rate * 1.05);
        tat := "worker".take_pace(q);
        IF tat IS NULL THEN
            -- Busy for longer than a claim takes to commit: another claim paces this queue and
            -- is stuck (a frozen worker). Try again in a moment.
            wait_seconds := 0.02;
            room := 0;
        END IF;
    END IF;

    IF lim.key_rate IS NOT NULL THEN
        key_gap := make_interval(secs => lim.key_rate_seconds / lim.key_rate * 1.05);
    END IF;

    IF room > 0 AND NOT keyed THEN
        take := room;
        IF lim.rate IS NOT NULL THEN
            take := least(room, coalesce(fit, 0));
        END IF;
        -- The queue's first rows in claim order, as many as the limits allow.
        IF take > 0 THEN
            SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(c.attempts + 1), '{}')
              INTO ids, atts
              FROM (SELECT t.id, t.attempts FROM "worker".tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT take
                       FOR UPDATE SKIP LOCKED) AS c;
        END IF;
        IF lim.rate IS NOT NULL AND cardinality(ids) > 0 THEN
            -- The pace in closed form (see take_starts): the i-th start from m.
            start_at := ARRAY(SELECT greatest(pt0, m + (i - burst) * gap)
                                FROM generate_series(1, cardinality(ids)) AS i ORDER BY i);
        END IF;
    ELSIF room > 0 THEN
        -- Per key: the first rows of each key (one probe of tasks_limit_key_idx per key with
        -- queued rows, found by a skip scan), merged in claim order with the rows without a
        -- key (among the queue's first rows only), so that a key at its limit with a deep
        -- backlog costs the others nothing. Each row is then taken if its key has a permit and
        -- its pace allows it, and if no other claim has locked it.
        FOR cand IN
            WITH RECURSIVE keys AS (
                (SELECT t.limit_key AS k FROM "worker".tasks AS t
                  WHERE t.queue = q AND t.state = 'queued' AND t.limit_key IS NOT NULL
                  ORDER BY t.limit_key LIMIT 1)
                UNION ALL
                SELECT (SELECT t.limit_key FROM "worker".tasks AS t
                         WHERE t.queue = q AND t.state = 'queued' AND t.limit_key IS NOT NULL
                           AND t.limit_key > keys.k
                         ORDER BY t.limit_key LIMIT 1)
                  FROM keys WHERE keys.k IS NOT NULL
            ), candidates AS (
                SELECT f.id, f.attempts, f.k, f.neg_priority, f.run_at
                  FROM keys
                 CROSS JOIN LATERAL (
                    SELECT t.id, t.attempts, t.limit_key AS k, -t.priority AS neg_priority,
                           t.run_at
                      FROM "worker".tasks AS t
                     WHERE t.queue = q AND t.state = 'queued' AND t.limit_key = keys.k
                       AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT room) AS f
                 WHERE keys.k IS NOT NULL
                UNION ALL
                SELECT u.id, u.attempts, NULL, u.neg_priority, u.run_at FROM (
                    SELECT t.id, t.attempts, -t.priority AS neg_priority, t.run_at, t.limit_key
                      FROM "worker".tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT 256) AS u
                 WHERE u.limit_key IS NULL
            )
            SELECT c.id, c.attempts, c.k FROM candidates AS c
             ORDER BY c.neg_priority, c.run_at, c.id
        LOOP
            EXIT WHEN cardinality(ids) >= room;
            CONTINUE WHEN cand.k = ANY(kbusy);
            s := NULL;
            kslot := NULL;
            IF cand.k IS NOT NULL AND lim.key_concurrency IS NOT NULL THEN
                kslot := "worker".take_key_permit(
                    q, cand.k, lim.key_concurrency,
                    ARRAY(SELECT x.s FROM unnest(rowkeys, rowslots) AS x(k, s)
                           WHERE x.k = cand.k AND x.s IS NOT NULL));
                IF kslot IS NULL THEN
                    kbusy := kbusy || cand.k;
                    held := true;
                    CONTINUE;
                END IF;
            END IF;
            IF cand.k IS NOT NULL AND lim.key_rate IS NOT NULL THEN
                s := "worker".take_key_start(q, cand.k, key_gap, coalesce(lim.key_burst, 1),
                                             t0, horizon);
                IF s IS NULL THEN
                    -- The key's pace allows nothing more now (or another claim has it).
                    kbusy := kbusy || cand.k;
                    wait_seconds := least(coalesce(wait_seconds, 1e9), greatest(extract(
                        epoch FROM (SELECT r.tat FROM "worker".limit_rates AS r
                                     WHERE r.queue = q AND r.limit_key = cand.k)
                                   - (coalesce(lim.key_burst, 1) - 1) * key_gap - horizon),
                        0.001));
                END IF;
            END IF;
            IF lim.rate IS NOT NULL AND (cand.k IS NULL OR lim.key_rate IS NULL OR s IS NOT NULL)
            THEN
                s := greatest(coalesce(s, t0), tat - (coalesce(lim.burst, 1) - 1) * gap);
                IF s > horizon THEN
                    wait_seconds := least(coalesce(wait_seconds, 1e9),
                                          greatest(extract(epoch FROM s - horizon), 0.001));
                    s := NULL;
                    kbusy := kbusy || coalesce(cand.k, '');
                END IF;
            END IF;
            IF (cand.k IS NOT NULL AND lim.key_rate IS NOT NULL AND s IS NULL)
               OR (lim.rate IS NOT NULL AND s IS NULL AND (cand.k IS NULL OR lim.key_rate IS NULL))
               OR NOT EXISTS (SELECT 1 FROM "worker".tasks AS t
                               WHERE t.id = cand.id AND t.state = 'queued'
                                 FOR UPDATE SKIP LOCKED)
            THEN
                -- Not taken after all (the permit locked for it stays free).
                CONTINUE;
            END IF;
            IF lim.rate IS NOT NULL THEN
                tat := greatest(tat, s) + gap;
            END IF;
            ids := ids || cand.id;
            atts := atts || (cand.attempts + 1);
            start_at := start_at || s;
            rowkeys := rowkeys || coalesce(cand.k, '');
            rowslots := rowslots || kslot;
        END LOOP;
    END IF;

    IF NOT keyed AND fit > cardinality(ids) THEN
        -- Starts taken and not used (fewer rows, fewer permits, or none asked after all) go back
        -- to the pace, unless another claim took starts after them meanwhile.
        PERFORM "worker".give_back_pace(q, m, gap, cardinality(ids), pend);
    END IF;
    IF keyed AND lim.rate IS NOT NULL AND tat IS NOT NULL AND cardinality(ids) > 0 THEN
        UPDATE "worker".limit_rates AS r
           SET tat = greatest(r.tat, tat),
               window_starts = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                    THEN r.window_starts + cardinality(ids)
                                    ELSE cardinality(ids) END,
               window_start = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                   THEN r.window_start ELSE t0 END
         WHERE r.queue = q AND r.limit_key = '';
    END IF;
    IF lim.concurrency IS NOT NULL AND cardinality(ids) > 0 THEN
        -- The permits used name their rows and the attempt the claim makes; the others were
        -- only locked, and are free to the next claim. No column of an index changes: the
        -- update stays on its page (a heap-only tuple), however often permits turn over.
        -- The permits taken are the lowest free ones: one short range of the primary key (each
        -- key of `= ANY(used)` would be a descent of its own, several times slower).
        -- Each permit finds its row through `pos` (slot - lo + 1 -> its place in `used`): one
        -- array look-up per permit, not a search of the batch (batch x batch comparisons).
        used := permits[1:cardinality(ids)];
        lo := used[1];
        pos := array_fill(NULL::integer, ARRAY[used[cardinality(used)] - lo + 1]);
        FOR ix IN 1..cardinality(used) LOOP
            pos[used[ix] - lo + 1] := ix;
        END LOOP;
        UPDATE "worker".limit_permits AS p
           SET task_id = ids[pos[p.slot - lo + 1]],
               attempt = atts[pos[p.slot - lo + 1]],
               taken_by = pg_current_xact_id()
         WHERE p.queue = q AND p.limit_key = ''
           AND p.slot BETWEEN lo AND used[cardinality(used)]
           AND pos[p.slot - lo + 1] IS NOT NULL;
    END IF;
    IF lim.key_concurrency IS NOT NULL AND cardinality(ids) > 0 THEN
        UPDATE "worker".limit_permits AS p
           SET task_id = x.id, attempt = x.att, taken_by = pg_current_xact_id()
          FROM unnest(rowslots, rowkeys, ids, atts) AS x(slot, k, id, att)
         WHERE x.slot IS NOT NULL AND p.queue = q AND p.limit_key = x.k AND p.slot = x.slot;
    END IF;
    IF wait_seconds >= 1e9 THEN
        wait_seconds := NULL;
    END IF;
END;
$$;

-- Name: clear_queue_limit(text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.clear_queue_limit(queue text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
BEGIN
    DELETE FROM "worker".queue_limits AS l WHERE l.queue = clear_queue_limit.queue;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM "worker".sync_limit_permits(clear_queue_limit.queue);
    RETURN true;
END;
$$;

-- Name: create_workflow(jsonb, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.create_workflow(steps jsonb, name text DEFAULT ''::text) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
DECLARE
    wf      bigint;
    keys    jsonb := '{}';
    s       jsonb;
    dep     jsonb;
    k       text;
    ref     text;
    new_id  bigint;
    i       integer := 0;
    pos     integer;
    deps    jsonb;
BEGIN
    IF steps IS NULL OR jsonb_typeof(steps) <> 'array' OR jsonb_array_length(steps) = 0 THEN
        RAISE EXCEPTION 'create_workflow: steps must be a non-empty JSON array of steps'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO "worker".workflows (name) VALUES (left(coalesce(name, ''), 255)) RETURNING id INTO wf;
    FOR s IN SELECT x FROM jsonb_array_elements(steps) AS x LOOP
        i := i + 1;
        IF jsonb_typeof(s) <> 'object' OR jsonb_typeof(s -> 'task') IS DISTINCT FROM 'string' THEN
            RAISE EXCEPTION 'create_workflow: step % must be an object with a "task"', i
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        k := coalesce(s ->> 'key', i::text);
        IF keys ? k THEN
            RAISE EXCEPTION 'create_workflow: two steps have the key %', quote_literal(k)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        deps := coalesce(s -> 'depends_on', '[]');
        IF jsonb_typeof(deps) <> 'array' THEN
            RAISE EXCEPTION 'create_workflow: "depends_on" of step % must be an array', quote_literal(k)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        INSERT INTO "worker".tasks AS t
               (task, payload, queue, priority, max_attempts, run_at, workflow_id, state)
        VALUES (s ->> 'task', coalesce(s -> 'payload', '{}'), s ->> 'queue',
                coalesce((s ->> 'priority')::integer, 0), (s ->> 'max_attempts')::integer,
                coalesce((s ->> 'run_at')::timestamptz, now()), wf,
                CASE WHEN jsonb_array_length(deps) > 0 THEN 'waiting'::"worker".task_state
                     ELSE 'queued' END)
        RETURNING t.id INTO new_id;
        pos := 0;
        FOR dep IN SELECT x FROM jsonb_array_elements(deps) AS x LOOP
            ref := CASE jsonb_typeof(dep) WHEN 'string' THEN dep #>> '{}'
                                          WHEN 'number' THEN dep #>> '{}'
                                          WHEN 'object' THEN dep ->> 'step' END;
            IF ref = k THEN
                RAISE EXCEPTION 'create_workflow: step % depends on itself', quote_literal(k)
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            IF ref IS NULL OR NOT keys ? ref THEN
                RAISE EXCEPTION 'create_workflow: step % depends on %, which is not listed before it (list each step after the steps it depends on)',
                    quote_literal(k), coalesce(quote_literal(ref), 'nothing')
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            INSERT INTO "worker".task_deps (task_id, depends_on, run_on_failure, position)
            VALUES (new_id, (keys ->> ref)::bigint,
                    coalesce(jsonb_typeof(dep) = 'object' AND (dep ->> 'run_on_failure')::boolean,
                             false),
                    pos);
            pos := pos + 1;
        END LOOP;
        keys := keys || jsonb_build_object(k, new_id);
    END LOOP;
    RETURN wf;
END;
$$;

-- Name: enqueue(text, jsonb, text, timestamp with time zone, integer, integer, text, jsonb); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.enqueue(task text, payload jsonb DEFAULT '{}'::jsonb, queue text DEFAULT NULL::text, run_at timestamp with time zone DEFAULT now(), priority integer DEFAULT 0, max_attempts integer DEFAULT NULL::integer, dedupe_key text DEFAULT NULL::text, trace_context jsonb DEFAULT NULL::jsonb) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
    #variable_conflict use_column
    DECLARE
        new_id bigint;
    BEGIN
        FOR i IN 1..10 LOOP
            IF enqueue.dedupe_key IS NOT NULL THEN
                SELECT t.id INTO new_id FROM "worker".tasks AS t
                 WHERE t.dedupe_key = enqueue.dedupe_key
                   AND t.state IN ('scheduled', 'queued', 'in_progress');
                IF new_id IS NOT NULL THEN
                    RETURN new_id;
                END IF;
            END IF;
            INSERT INTO "worker".tasks AS t
                   (task, payload, queue, run_at, priority, max_attempts, dedupe_key, trace_context)
            VALUES (enqueue.task, coalesce(enqueue.payload, '{}'), enqueue.queue,
                    coalesce(enqueue.run_at, now()), coalesce(enqueue.priority, 0),
                    enqueue.max_attempts, enqueue.dedupe_key, enqueue.trace_context)
            ON CONFLICT (dedupe_key)
                WHERE dedupe_key IS NOT NULL AND state IN ('scheduled', 'queued', 'in_progress')
            DO NOTHING
            RETURNING id INTO new_id;
            IF new_id IS NOT NULL THEN
                RETURN new_id;
            END IF;
        END LOOP;
        RAISE EXCEPTION
            'enqueue: could not settle dedupe_key % (is the transaction REPEATABLE READ?)',
            enqueue.dedupe_key;
    END;
    $$;

-- Name: enqueue_keyed(text, jsonb, text, timestamp with time zone, integer, integer, text, text, jsonb); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.enqueue_keyed(task text, payload jsonb DEFAULT '{}'::jsonb, queue text DEFAULT NULL::text, run_at timestamp with time zone DEFAULT now(), priority integer DEFAULT 0, max_attempts integer DEFAULT NULL::integer, dedupe_key text DEFAULT NULL::text, limit_key text DEFAULT NULL::text, trace_context jsonb DEFAULT NULL::jsonb) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
DECLARE
    new_id bigint;
BEGIN
    new_id := "worker".enqueue(task => task, payload => payload, queue => queue,
                               run_at => run_at, priority => priority,
                               max_attempts => max_attempts, dedupe_key => dedupe_key,
                               trace_context => trace_context);
    IF limit_key IS NOT NULL THEN
        UPDATE "worker".tasks AS t SET limit_key = enqueue_keyed.limit_key
         WHERE t.id = new_id AND t.limit_key IS NULL AND t.state IN ('queued', 'scheduled')
           AND t.attempts = 0;
    END IF;
    RETURN new_id;
END;
$$;

-- Name: estimated_rows(text, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.estimated_rows(queue text, state text) RETURNS double precision
    LANGUAGE plpgsql
    AS $$
DECLARE
    plan  json;
    total float8;
    part  regclass;
    rows  float8;
BEGIN
    EXECUTE format('EXPLAIN (FORMAT JSON) SELECT 1 FROM "worker".tasks WHERE queue = %L AND state = %L',
                   queue, state)
       INTO plan;
    total := (plan -> 0 -> 'Plan' ->> 'Plan Rows')::float8;
    IF state = 'done' THEN
        FOR part IN SELECT c.oid::regclass
                      FROM pg_inherits AS i
                      JOIN pg_class AS c ON c.oid = i.inhrelid
                     WHERE i.inhparent = '"worker".task_history'::regclass AND c.reltuples > 0
        LOOP
            EXECUTE format('EXPLAIN (FORMAT JSON) SELECT 1 FROM %s WHERE queue = %L', part, queue)
               INTO plan;
            rows := (plan -> 0 -> 'Plan' ->> 'Plan Rows')::float8;
            IF rows > 1 THEN
                total := total + rows;
            END IF;
        END LOOP;
    END IF;
    RETURN total;
END;
$$;

-- Name: finish_action(bigint, jsonb, boolean, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.finish_action(action_id bigint, counts jsonb, finished boolean DEFAULT true, interrupted text DEFAULT NULL::text) RETURNS void
    LANGUAGE sql
    AS $$
    UPDATE "worker".actions AS a
       SET counts = coalesce(finish_action.counts, a.counts, '{}'),
           finished_at = CASE WHEN finish_action.finished OR finish_action.interrupted IS NOT NULL
                              THEN now() END,
           interrupted = left(nullif(finish_action.interrupted, ''), 100)
     WHERE a.id = finish_action.action_id;
$$;

-- Name: give_back_pace(text, timestamp with time zone, interval, integer, timestamp with time zone); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.give_back_pace(q text, m timestamp with time zone, gap interval, used integer, taken_end timestamp with time zone) RETURNS void
    LANGUAGE sql
    AS $$
    UPDATE "worker".limit_rates AS r
       SET tat = m + used * gap,
           window_starts = greatest(r.window_starts
                                    - round(extract(epoch FROM taken_end - (m + used * gap))
                                            / nullif(extract(epoch FROM gap), 0))::integer, 0)
     WHERE r.queue = q AND r.limit_key = '' AND r.tat = taken_end
       AND r.ctid = (SELECT x.ctid FROM "worker".limit_rates AS x
                      WHERE x.queue = q AND x.limit_key = '' FOR UPDATE SKIP LOCKED);
$$;

-- Name: make_key_limits(text, text, integer); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.make_key_limits(q text, k text, c integer) RETURNS void
    LANGUAGE plpgsql
    SET lock_timeout TO '50ms'
    AS $$
BEGIN
    IF c IS NOT NULL THEN
        INSERT INTO "worker".limit_permits (queue, limit_key, slot)
        SELECT q, k, g FROM generate_series(1, c) AS g ON CONFLICT DO NOTHING;
    ELSE
        INSERT INTO "worker".limit_rates (queue, limit_key) VALUES (q, k) ON CONFLICT DO NOTHING;
    END IF;
END;
$$;

-- Name: notify_inserted(); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.notify_inserted() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    names text;
    earliest timestamptz;
    odd boolean;
BEGIN
    SELECT string_agg(q, ','), min(e), bool_or(strpos(q, ',') > 0 OR strpos(q, chr(30)) > 0)
      INTO names, earliest, odd
      FROM (SELECT queue AS q, min(run_at) AS e FROM inserted WHERE state = 'queued'
             GROUP BY queue LIMIT 50) AS d;
    IF names IS NOT NULL THEN
        IF odd OR octet_length(names) > 7000 OR NOT isfinite(earliest) THEN
            -- "Look at every queue" (a name holding a comma cannot be listed, a run_at of
            -- -infinity has no number): workers then read each queue, from its start.
            names := '';
        ELSE
            names := names || ',' || chr(30)
                     || (extract(epoch FROM earliest) * 1000000)::bigint::text;
        END IF;
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.tasks', names);
    END IF;
    RETURN NULL;
END;
$$;

-- Name: pace_ahead(text, integer, double precision); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.pace_ahead(q text, want integer, lookahead double precision DEFAULT 0.5, OUT t0 timestamp with time zone, OUT m timestamp with time zone, OUT gap_seconds double precision, OUT burst integer, OUT n integer, OUT wait_seconds double precision, OUT tat_end timestamp with time zone) RETURNS record
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
BEGIN
    IF NOT EXISTS (SELECT 1 FROM "worker".queue_limits AS l
                    WHERE l.queue = q AND l.rate IS NOT NULL AND l.concurrency IS NULL
                      AND l.key_concurrency IS NULL AND l.key_rate IS NULL) THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM "worker".paused_queues AS p WHERE p.queue = q) THEN
        n := 0;
        RETURN;
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT s.t0, s.m, s.gap_seconds, s.burst, s.n, s.wait_seconds, s.tat_end
      INTO t0, m, gap_seconds, burst, n, wait_seconds, tat_end
      FROM "worker".take_starts(q, want, lookahead) AS s;
END;
$$;

-- Name: pause_queue(text, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.pause_queue(queue text, paused_by text DEFAULT CURRENT_USER) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
BEGIN
    IF pause_queue.queue IS NULL OR pause_queue.queue = ''
            OR char_length(pause_queue.queue) > 255 THEN
        RAISE EXCEPTION 'a queue name is 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    INSERT INTO "worker".paused_queues (queue, paused_by)
    VALUES (pause_queue.queue, left(coalesce(pause_queue.paused_by, ''), 200))
    ON CONFLICT (queue) DO NOTHING;
    RETURN FOUND;  -- false: it was paused already, and its first pause stands
END;
$$;

-- Name: record_action(text, text, jsonb, jsonb, text, boolean, text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.record_action(actor text, action text, filter jsonb DEFAULT '{}'::jsonb, counts jsonb DEFAULT '{}'::jsonb, source text DEFAULT ''::text, finished boolean DEFAULT true, address text DEFAULT ''::text) RETURNS bigint
    LANGUAGE sql
    AS $$
    INSERT INTO "worker".actions (actor, action, filter, counts, source, finished_at, address)
    VALUES (left(coalesce(nullif(actor, ''), session_user::text), 200), left(action, 100),
            coalesce(filter, '{}'), coalesce(counts, '{}'), left(coalesce(source, ''), 200),
            CASE WHEN finished THEN now() END, left(coalesce(address, ''), 100))
    RETURNING id;
$$;

-- Name: requeue(bigint[], boolean); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.requeue(ids bigint[], dry_run boolean DEFAULT false) RETURNS TABLE(requeued bigint[], skipped bigint[])
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
DECLARE
    tries integer := 0;
BEGIN
    LOOP
        BEGIN
            WITH batch AS (
                SELECT t.id, t.finished_at, t.dedupe_key
                  FROM "worker".tasks AS t
                 WHERE t.id = ANY(ids) AND t.state IN ('failed', 'cancelled')
                 ORDER BY t.id
                   FOR UPDATE
            ), checked AS (
                SELECT b.id,
                       b.dedupe_key IS NOT NULL
                       AND (row_number() OVER (PARTITION BY b.dedupe_key
                                               ORDER BY b.finished_at, b.id) > 1
                            OR EXISTS (SELECT 1 FROM "worker".tasks AS h
                                        WHERE h.dedupe_key = b.dedupe_key
                                          AND h.state IN ('scheduled', 'queued', 'in_progress')))
                       AS taken
                  FROM batch AS b
            ), moved AS (
                UPDATE "worker".tasks AS t
                   SET state = 'queued', run_at = now(), attempts = 0, finished_at = NULL,
                       lease_expires_at = NULL, cancel_requested_at = NULL, cancelled_by = NULL
                 WHERE NOT dry_run
                   AND t.id = ANY(ARRAY(SELECT c.id FROM checked AS c WHERE NOT c.taken))
                   AND t.state IN ('failed', 'cancelled')
                RETURNING t.id
            )
            SELECT coalesce(array_agg(c.id ORDER BY c.id) FILTER (WHERE NOT c.taken), '{}'),
                   coalesce(array_agg(c.id ORDER BY c.id) FILTER (WHERE c.taken), '{}')
              INTO requeued, skipped
              FROM checked AS c;
            EXIT;
        EXCEPTION WHEN unique_violation THEN
            tries := tries + 1;
            IF tries >= 3 THEN
                RAISE;
            END IF;
        END;
    END LOOP;
    IF NOT dry_run AND cardinality(requeued) > 0 THEN
        -- Steps of workflows take up their workflow again (schema/0021).
        PERFORM "worker".resume_steps(requeued);
        PERFORM pg_notify(array_to_string(parse_ident('"worker".tasks'), '.'), '');
    END IF;
    RETURN NEXT;
END;
$$;

-- Name: resume_queue(text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.resume_queue(queue text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
BEGIN
    DELETE FROM "worker".paused_queues AS p WHERE p.queue = resume_queue.queue;
    IF NOT FOUND THEN
        RETURN false;  -- it was not paused
    END IF;
    -- The channel of the insert trigger (schema/0006): the schema's name and '.tasks'.
    PERFORM pg_notify(n.nspname || '.tasks', resume_queue.queue)
       FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
      WHERE c.oid = '"worker".tasks'::regclass;
    RETURN true;
END;
$$;

-- Name: resume_steps(bigint[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.resume_steps(ids bigint[]) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    frontier bigint[] := ids;
    children bigint[];
BEGIN
    WITH c AS (
        SELECT d.task_id AS id, count(*) FILTER (WHERE d.outcome IS NULL)::integer AS n
          FROM "worker".task_deps AS d WHERE d.task_id = ANY(ids) GROUP BY d.task_id
    )
    UPDATE "worker".tasks AS t
       SET pending_deps = c.n,
           state = CASE WHEN c.n > 0 THEN 'waiting'::"worker".task_state ELSE t.state END,
           inputs = CASE WHEN c.n = 0 THEN (
               SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                 FROM "worker".task_deps AS d WHERE d.task_id = t.id) END
      FROM c
     WHERE t.id = c.id AND t.state = 'queued';
    WHILE cardinality(frontier) > 0 LOOP
        WITH e AS (
            UPDATE "worker".task_deps AS d SET outcome = NULL, result = NULL
              FROM "worker".tasks AS c
             WHERE d.depends_on = ANY(frontier) AND d.outcome IS NOT NULL
               AND c.id = d.task_id AND c.state = 'cancelled' AND c.cancelled_by = 'workflow'
            RETURNING d.task_id, d.depends_on
        ), armed AS (
            UPDATE "worker".tasks AS t SET dependents = true
             WHERE t.id = ANY(ARRAY(SELECT e.depends_on FROM e))
        )
        SELECT coalesce(array_agg(DISTINCT e.task_id), '{}') INTO children FROM e;
        WITH c AS (
            SELECT d.task_id AS id, count(*) FILTER (WHERE d.outcome IS NULL)::integer AS n,
                   coalesce(bool_or(d.outcome IN ('failed', 'cancelled') AND NOT d.run_on_failure),
                            false) AS doomed
              FROM "worker".task_deps AS d WHERE d.task_id = ANY(children) GROUP BY d.task_id
        ), back AS (
            UPDATE "worker".tasks AS t
               SET state = 'waiting', pending_deps = c.n, finished_at = NULL, inputs = NULL,
                   cancelled_by = NULL, cancel_requested_at = NULL, last_error = NULL
              FROM c
             WHERE t.id = c.id AND NOT c.doomed
               AND t.state = 'cancelled' AND t.cancelled_by = 'workflow'
            RETURNING t.id
        )
        SELECT coalesce(array_agg(b.id), '{}') INTO frontier FROM back AS b;
    END LOOP;
END;
$$;

-- Name: rotate_history(double precision, double precision); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.rotate_history(keep_seconds double precision, slice_seconds double precision DEFAULT NULL::double precision) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    cur     "worker".history_slots;
    nxt     smallint;
    slice   interval := make_interval(secs => coalesce(slice_seconds, keep_seconds / 6));
    emptied integer := 0;
    s       smallint;
    held    boolean;
BEGIN
    SELECT * INTO cur FROM "worker".history_slots WHERE state = 'current' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 0;  -- another worker rotates right now
    END IF;
    -- A slot is emptied only when no transaction holds it: wait 50 ms at most, then leave it to
    -- the next pass (readers by id lock every slot, and must not queue behind the TRUNCATE).
    PERFORM set_config('lock_timeout', '50ms', true);
    FOR s IN SELECT h.slot FROM "worker".history_slots AS h
              WHERE h.state = 'closed'
                AND h.closed_at < now() - make_interval(secs => keep_seconds)
              ORDER BY h.closed_at
    LOOP
        BEGIN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)',
                           '"worker".' || quote_ident('task_history_' || s)) INTO held;
            IF held THEN
                EXECUTE format('TRUNCATE %s', '"worker".' || quote_ident('task_history_' || s));
            END IF;
            UPDATE "worker".history_slots AS h SET state = 'empty', closed_at = NULL
             WHERE h.slot = s;
            emptied := emptied + 1;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- held by a reader or a late writer: the next pass
        END;
    END LOOP;
    IF now() - cur.opened_at >= slice THEN
        nxt := cur.slot % 8 + 1;
        IF (SELECT h.state FROM "worker".history_slots AS h WHERE h.slot = nxt) = 'empty' THEN
            -- closed_at is read from the clock at the switch, after every row this slot got
            -- from a statement that read it as current before now (their finished_at is earlier).
            UPDATE "worker".history_slots AS h SET state = 'closed', opened_at = NULL,
                   closed_at = clock_timestamp()
             WHERE h.slot = cur.slot;
            UPDATE "worker".history_slots AS h SET state = 'current', opened_at = now()
             WHERE h.slot = nxt;
        END IF;
    END IF;
    RETURN emptied;
END;
$$;

-- Name: set_queue_limit(text, bigint, bigint, bigint, double precision, bigint, double precision, text, text, bigint, bigint); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.set_queue_limit(queue text, concurrency bigint DEFAULT NULL::bigint, key_concurrency bigint DEFAULT NULL::bigint, rate bigint DEFAULT NULL::bigint, rate_seconds double precision DEFAULT NULL::double precision, key_rate bigint DEFAULT NULL::bigint, key_rate_seconds double precision DEFAULT NULL::double precision, source text DEFAULT 'operator'::text, updated_by text DEFAULT CURRENT_USER, burst bigint DEFAULT NULL::bigint, key_burst bigint DEFAULT NULL::bigint) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
DECLARE
    changed boolean;
    r       record;
BEGIN
    IF queue IS NULL OR queue = '' OR char_length(queue) > 255 THEN
        RAISE EXCEPTION 'a queue name is 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    IF source IS NULL OR source NOT IN ('code', 'operator') THEN
        RAISE EXCEPTION 'source is ''code'' or ''operator'', not %', coalesce(source, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF num_nonnulls(concurrency, key_concurrency, rate, key_rate) = 0 THEN
        RAISE EXCEPTION 'give at least one limit: concurrency, key_concurrency, rate or key_rate'
            USING ERRCODE = '22023', HINT = 'clear_queue_limit(queue) removes a queue''s limits.';
    END IF;
    IF concurrency < 0 OR concurrency > 100000 THEN
        RAISE EXCEPTION 'concurrency must be 0 to 100000 tasks running at once, not %',
            concurrency USING ERRCODE = '22023';
    END IF;
    IF key_concurrency < 0 OR key_concurrency > 100000 THEN
        RAISE EXCEPTION 'key_concurrency must be 0 to 100000 tasks running at once, not %',
            key_concurrency USING ERRCODE = '22023';
    END IF;
    FOR r IN SELECT * FROM (VALUES
        ('rate', rate, rate_seconds, burst, 'burst'),
        ('key_rate', key_rate, key_rate_seconds, key_burst, 'key_burst')) AS v(name, n, s, b, bname)
    LOOP
        IF r.n IS NULL THEN
            IF r.s IS NOT NULL THEN
                RAISE EXCEPTION '%_seconds goes with %', r.name, r.name USING ERRCODE = '22023';
            END IF;
            IF r.b IS NOT NULL THEN
                RAISE EXCEPTION '% goes with %', r.bname, r.name USING ERRCODE = '22023';
            END IF;
            CONTINUE;
        END IF;
        IF r.n < 1 OR r.n > 1000000000 THEN
            RAISE EXCEPTION '% must be 1 to 1000000000 starts per period, not %', r.name, r.n
                USING ERRCODE = '22023',
                      HINT = 'A queue that should start nothing: pause it, or set a concurrency of 0.';
        END IF;
        IF r.s IS NOT NULL AND (r.s = 'NaN' OR r.s <= 0 OR r.s > 31622400) THEN
            RAISE EXCEPTION '%_seconds must be more than 0 and at most 31622400 (a year), not %',
                r.name, r.s USING ERRCODE = '22023';
        END IF;
        IF r.n / coalesce(r.s, 1) > 1000000 THEN
            RAISE EXCEPTION '% is at most 1000000 starts a second, not % per % s', r.name, r.n,
                coalesce(r.s, 1) USING ERRCODE = '22023';
        END IF;
        IF r.b IS NOT NULL AND (r.b < 1 OR r.b > 100000) THEN
            RAISE EXCEPTION '% must be 1 to 100000 starts at once, not %', r.bname, r.b
                USING ERRCODE = '22023';
        END IF;
    END LOOP;
    IF rate IS NOT NULL AND rate_seconds IS NULL THEN
        rate_seconds := 1;
    END IF;
    IF key_rate IS NOT NULL AND key_rate_seconds IS NULL THEN
        key_rate_seconds := 1;
    END IF;
    INSERT INTO "worker".queue_limits AS l
        (queue, concurrency, key_concurrency, rate, rate_seconds, key_rate, key_rate_seconds,
         burst, key_burst, source, updated_by)
    VALUES (queue, concurrency, key_concurrency, rate, rate_seconds, key_rate, key_rate_seconds,
            burst, key_burst, source, left(coalesce(updated_by, ''), 200))
    ON CONFLICT ON CONSTRAINT queue_limits_pkey DO UPDATE
       SET concurrency = excluded.concurrency, key_concurrency = excluded.key_concurrency,
           rate = excluded.rate, rate_seconds = excluded.rate_seconds,
           key_rate = excluded.key_rate, key_rate_seconds = excluded.key_rate_seconds,
           burst = excluded.burst, key_burst = excluded.key_burst,
           source = excluded.source, updated_by = excluded.updated_by, updated_at = now()
     -- Code never overrides an operator's setting (see the table).
     WHERE excluded.source = 'operator' OR l.source = 'code';
    changed := FOUND;
    PERFORM "worker".sync_limit_permits(queue);
    RETURN changed;
END;
$$;

-- Name: settle_missed(integer); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.settle_missed(batch integer DEFAULT 1000) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    n        integer;
    freed    integer;
    queues   text[];
    earliest timestamptz;
BEGIN
    n := "worker".settle_steps(ARRAY(
        SELECT t.id FROM "worker".tasks AS t
         WHERE t.dependents AND t.state IN ('done', 'failed', 'cancelled')
         ORDER BY t.id LIMIT batch
           FOR UPDATE SKIP LOCKED));
    WITH free AS (
        SELECT t.id FROM "worker".tasks AS t
         WHERE t.state = 'waiting' AND coalesce(t.pending_deps, 0) <= 0
         ORDER BY t.id LIMIT batch
           FOR UPDATE SKIP LOCKED
    ), counted AS (
        SELECT f.id, (SELECT count(*) FROM "worker".task_deps AS d
                       WHERE d.task_id = f.id AND d.outcome IS NULL)::integer AS pending
          FROM free AS f
    ), moved AS (
        UPDATE "worker".tasks AS t
           SET pending_deps = c.pending,
               state = CASE WHEN c.pending > 0 THEN 'waiting'::"worker".task_state
                            WHEN t.run_at > now() THEN 'scheduled' ELSE 'queued' END,
               run_at = CASE WHEN c.pending > 0 THEN t.run_at ELSE greatest(t.run_at, now()) END,
               inputs = CASE WHEN c.pending = 0 THEN (
                   SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                     FROM "worker".task_deps AS d WHERE d.task_id = t.id) END
          FROM counted AS c
         WHERE t.id = c.id
           -- The rows by primary key, whatever the planner believes the table holds.
           AND t.id = ANY(ARRAY(SELECT f.id FROM free AS f))
        RETURNING t.state, t.queue, t.run_at
    )
    SELECT count(*) FILTER (WHERE m.state = 'queued')::integer,
           coalesce(array_agg(m.queue) FILTER (WHERE m.state = 'queued'), '{}'),
           min(m.run_at) FILTER (WHERE m.state = 'queued')
      INTO freed, queues, earliest
      FROM moved AS m;
    PERFORM "worker".wake_steps(queues, earliest);
    RETURN n + freed;
END;
$$;

-- Name: settle_released(bigint[], integer[], bigint[], text[], text[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.settle_released(kids bigint[], counts integer[], blockers bigint[], errors text[], quiet text[] DEFAULT '{}'::text[], OUT released integer, OUT ready_queues text[]) RETURNS record
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_nestloop TO 'off'
    AS $$
DECLARE
    n        integer;
    woken    text[] := '{}';
    earliest timestamptz;
    first_at timestamptz;
    queues   text[];
    parents  bigint[];
    pstates  text[];
    presults jsonb[];
    ptasks   text[];
BEGIN
    released := 0;
    WHILE cardinality(kids) > 0 LOOP
        -- In id order: the acknowledgements of other workers settle the same joins.
        PERFORM 1 FROM "worker".tasks AS t WHERE t.id = ANY(kids) ORDER BY t.id FOR UPDATE;
        -- A statement of its own, so that it sees what was committed before the locks.
        WITH c AS (
            SELECT * FROM unnest(kids, counts, blockers, errors) AS c(id, n, blocker, error)
        ), moved AS (
            UPDATE "worker".tasks AS t
               SET pending_deps = t.pending_deps - c.n,
                   state = CASE WHEN c.blocker IS NOT NULL THEN 'cancelled'::"worker".task_state
                                WHEN t.pending_deps - c.n > 0 THEN 'waiting'
                                WHEN t.run_at > now() THEN 'scheduled'
                                ELSE 'queued' END,
                   run_at = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0
                                 THEN greatest(t.run_at, now()) ELSE t.run_at END,
                   finished_at = CASE WHEN c.blocker IS NOT NULL THEN now() END,
                   cancelled_by = CASE WHEN c.blocker IS NOT NULL THEN 'workflow'
                                       ELSE t.cancelled_by END,
                   last_error = CASE WHEN c.blocker IS NOT NULL THEN c.error
                                     ELSE t.last_error END,
                   inputs = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0 THEN (
                       SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                         FROM "worker".task_deps AS d WHERE d.task_id = t.id) END
              FROM c
             WHERE t.id = c.id AND t.state = 'waiting'
               AND t.id = ANY(kids)  -- by primary key in every plan
            RETURNING t.id, t.state, t.queue, t.run_at, t.dependents
        )
        SELECT coalesce(array_agg(m.id) FILTER (WHERE m.state = 'cancelled' AND m.dependents), '{}'),
               count(*) FILTER (WHERE m.state = 'queued')::integer,
               coalesce(array_agg(m.queue) FILTER (WHERE m.state = 'queued'), '{}'),
               min(m.run_at) FILTER (WHERE m.state = 'queued')
          INTO parents, n, queues, first_at
          FROM moved AS m;
        released := released + n;
        woken := woken || queues;
        earliest := least(earliest, first_at);
        EXIT WHEN cardinality(parents) = 0;
        -- The steps a failure cancelled here, which others wait for in turn: settled now, their
        -- dependents next.
        WITH marked AS (
            UPDATE "worker".tasks AS t SET dependents = false
             WHERE t.id = ANY(parents) AND t.dependents
            RETURNING t.id, t.state::text AS state, t.result, t.task
        )
        SELECT array_agg(m.id), array_agg(m.state), array_agg(m.result), array_agg(m.task)
          INTO parents, pstates, presults, ptasks
          FROM marked AS m;
        SELECT s.kids, s.counts, s.blockers, s.errors INTO kids, counts, blockers, errors
          FROM "worker".step_edges(parents, pstates, presults, ptasks) AS s;
    END LOOP;
    -- The caller claims in the quiet queues in this same transaction, and wakes them itself if
    -- its claim may have left a step behind (see engine.batch).
    PERFORM "worker".wake_steps(ARRAY(SELECT w FROM unnest(woken) AS w WHERE w <> ALL(quiet)),
                                earliest);
    ready_queues := ARRAY(SELECT DISTINCT w FROM unnest(woken) AS w);
END;
$$;

-- Name: settle_steps(bigint[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.settle_steps(ids bigint[]) RETURNS integer
    LANGUAGE sql
    AS $$
    SELECT released FROM "worker".settle_steps_ready(ids);
$$;

-- Name: settle_steps_ready(bigint[], text[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.settle_steps_ready(ids bigint[], quiet text[] DEFAULT '{}'::text[], OUT released integer, OUT ready_queues text[]) RETURNS record
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    pids     bigint[];
    pstates  text[];
    presults jsonb[];
    ptasks   text[];
    e        record;
BEGIN
    WITH marked AS (
        UPDATE "worker".tasks AS t SET dependents = false
         WHERE t.id = ANY(ids) AND t.dependents
           AND t.state IN ('done', 'failed', 'cancelled')
        RETURNING t.id, t.state::text AS state, t.result, t.task
    ), p AS (
        SELECT * FROM marked
        UNION ALL
        SELECT t.id, t.state::text, t.result, t.task FROM "worker".tasks AS t
         WHERE t.id = ANY(ids) AND NOT t.dependents
           AND t.state IN ('done', 'failed', 'cancelled')
    )
    SELECT array_agg(p.id), array_agg(p.state), array_agg(p.result), array_agg(p.task)
      INTO pids, pstates, presults, ptasks
      FROM p;
    SELECT * INTO e FROM "worker".step_edges(pids, pstates, presults, ptasks);
    SELECT s.released, s.ready_queues INTO released, ready_queues
      FROM "worker".settle_released(e.kids, e.counts, e.blockers, e.errors, quiet) AS s;
END;
$$;

-- Name: step_edges(bigint[], text[], jsonb[], text[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.step_edges(ids bigint[], states text[], results jsonb[], tasks text[], OUT kids bigint[], OUT counts integer[], OUT blockers bigint[], OUT errors text[]) RETURNS record
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_nestloop TO 'off'
    AS $$
BEGIN
    -- An edge settled before is not settled again (outcome IS NULL): a step given twice counts
    -- once.
    WITH p AS (
        SELECT * FROM unnest(ids, states, results, tasks) AS p(id, state, result, task)
    ), e AS (
        UPDATE "worker".task_deps AS d
           SET outcome = p.state, result = CASE WHEN p.state = 'done' THEN p.result END
          FROM p
         WHERE d.depends_on = p.id AND d.outcome IS NULL
           AND d.depends_on = ANY(ids)  -- by key in every plan (see settle_released)
        RETURNING d.task_id, d.depends_on, d.run_on_failure, d.outcome, p.task
    ), c AS (
        -- Each dependent's count, its first blocking dependency and what to say about it, in
        -- one pass over the edges (a look-up of each dependent's error among all the edges made
        -- a fan-out from one step cost the square of its width).
        SELECT e.task_id AS id, count(*)::integer AS n,
               min(e.depends_on) FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure)
                   AS blocker,
               (array_agg(format('DependencyFailed: step %s (%s) ended %s',
                                 e.depends_on, left(e.task, 100), e.outcome)
                          ORDER BY e.depends_on)
                    FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure))[1] AS error
          FROM e GROUP BY e.task_id
    )
    SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}'),
           coalesce(array_agg(c.n ORDER BY c.id), '{}'),
           coalesce(array_agg(c.blocker ORDER BY c.id), '{}'),
           coalesce(array_agg(c.error ORDER BY c.id), '{}')
      INTO kids, counts, blockers, errors
      FROM c;
END;
$$;

-- Name: sync_limit_permits(text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.sync_limit_permits(q text) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    c integer;
BEGIN
    SELECT l.concurrency INTO c FROM "worker".queue_limits AS l WHERE l.queue = q;
    INSERT INTO "worker".limit_permits (queue, limit_key, slot)
    SELECT q, '', g FROM generate_series(1, coalesce(c, 0)) AS g
    ON CONFLICT DO NOTHING;
    DELETE FROM "worker".limit_permits AS p
     WHERE p.queue = q AND p.limit_key = '' AND p.slot > coalesce(c, 0);
    IF NOT EXISTS (SELECT 1 FROM "worker".queue_limits AS l
                    WHERE l.queue = q AND l.key_concurrency IS NOT NULL) THEN
        DELETE FROM "worker".limit_permits AS p WHERE p.queue = q AND p.limit_key <> '';
    END IF;
    IF EXISTS (SELECT 1 FROM "worker".queue_limits AS l WHERE l.queue = q AND l.rate IS NOT NULL)
    THEN
        INSERT INTO "worker".limit_rates (queue, limit_key) VALUES (q, '') ON CONFLICT DO NOTHING;
    ELSE
        DELETE FROM "worker".limit_rates AS r WHERE r.queue = q AND r.limit_key = '';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM "worker".queue_limits AS l
                    WHERE l.queue = q AND l.key_rate IS NOT NULL) THEN
        DELETE FROM "worker".limit_rates AS r WHERE r.queue = q AND r.limit_key <> '';
    END IF;
END;
$$;

-- Name: take_key_permit(text, text, integer, integer[]); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.take_key_permit(q text, k text, c integer, mine integer[]) RETURNS integer
    LANGUAGE plpgsql
    AS $$
DECLARE
    got integer;
BEGIN
    SELECT p.slot INTO got FROM "worker".free_permits AS p
     WHERE p.queue = q AND p.limit_key = k AND p.slot <= c AND p.slot <> ALL(mine)
     ORDER BY p.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN got;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM "worker".limit_permits AS p
                    WHERE p.queue = q AND p.limit_key = k) THEN
        BEGIN
            PERFORM "worker".make_key_limits(q, k, c);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
        RETURN "worker".take_key_permit(q, k, c, mine);
    END IF;
    RETURN NULL;
END;
$$;

-- Name: take_key_start(text, text, interval, integer, timestamp with time zone, timestamp with time zone); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.take_key_start(q text, k text, gap interval, burst integer, t0 timestamp with time zone, horizon timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE plpgsql
    AS $$
DECLARE
    pace timestamptz;
    s   timestamptz;
BEGIN
    SELECT r.tat INTO pace FROM "worker".limit_rates AS r
     WHERE r.queue = q AND r.limit_key = k FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        BEGIN
            PERFORM "worker".make_key_limits(q, k, NULL);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
        SELECT r.tat INTO pace FROM "worker".limit_rates AS r
         WHERE r.queue = q AND r.limit_key = k FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    s := greatest(t0, pace - (burst - 1) * gap);
    IF s > horizon THEN
        RETURN NULL;
    END IF;
    UPDATE "worker".limit_rates AS r SET tat = greatest(pace, s) + gap
     WHERE r.queue = q AND r.limit_key = k;
    RETURN s;
END;
$$;

-- Name: take_pace(text); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.take_pace(q text) RETURNS timestamp with time zone
    LANGUAGE plpgsql
    SET lock_timeout TO '20ms'
    AS $$
DECLARE
    pace timestamptz;
BEGIN
    SELECT r.tat INTO pace FROM "worker".limit_rates AS r
     WHERE r.queue = q AND r.limit_key = '' FOR UPDATE;
    RETURN pace;
EXCEPTION WHEN lock_not_available THEN
    RETURN NULL;
END;
$$;

-- Name: take_starts(text, integer, double precision); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.take_starts(q text, want integer, lookahead double precision DEFAULT 0.5, OUT t0 timestamp with time zone, OUT m timestamp with time zone, OUT gap_seconds double precision, OUT burst integer, OUT n integer, OUT wait_seconds double precision, OUT tat_end timestamp with time zone) RETURNS record
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_variable
DECLARE
    lim     "worker".queue_limits;
    gap     interval;
    tat     timestamptz;
    horizon timestamptz;
    fit     integer;
BEGIN
    SELECT * INTO lim FROM "worker".queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR lim.rate IS NULL THEN
        RETURN;
    END IF;
    -- The database clock now (not the transaction's start): the pace is counted from it.
    t0 := clock_timestamp();
    gap := make_interval(secs => lim.rate_seconds / lim.rate * 1.05);
    gap_seconds := extract(epoch FROM gap);
    burst := coalesce(lim.burst, 1);
    n := 0;
    IF want <= 0 THEN
        RETURN;
    END IF;
    tat := "worker".take_pace(q);
    IF tat IS NULL THEN
        -- Another transaction has held the pace for longer than taking starts takes (a claim
        -- stuck in its transaction: a frozen worker). Try again in a moment.
        wait_seconds := 0.02;
        RETURN;
    END IF;
    m := greatest(tat, t0);
    horizon := t0 + make_interval(secs => lookahead);
    fit := burst + floor(extract(epoch FROM horizon - m) / extract(epoch FROM gap))::integer;
    n := least(want, greatest(fit, 0));
    IF n < want THEN
        wait_seconds := greatest(extract(epoch FROM
            greatest(t0, m + (n + 1 - burst) * gap) - horizon), 0.001);
    END IF;
    tat_end := m + n * gap;
    IF n > 0 THEN
        UPDATE "worker".limit_rates AS r
           SET tat = tat_end,
               window_starts = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                    THEN r.window_starts + n ELSE n END,
               window_start = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                   THEN r.window_start ELSE t0 END
         WHERE r.queue = q AND r.limit_key = '';
    END IF;
END;
$$;

-- Name: task_deps_added(); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.task_deps_added() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_nestloop TO 'off'
    AS $$
DECLARE
    bad      record;
    doomed   bigint[];
    freed    integer;
    -- The steps and the dependencies of these edges: every look-up below names its rows with
    -- these (`= ANY`), so that it reads them by primary key whatever the planner believes the
    -- table holds, instead of joining the edges with the whole table.
    kids     bigint[] := ARRAY(SELECT DISTINCT a.task_id FROM added AS a);
    parents  bigint[] := ARRAY(SELECT DISTINCT a.depends_on FROM added AS a);
    finished bigint[];
BEGIN
    SELECT a.task_id INTO bad FROM added AS a WHERE a.task_id = a.depends_on LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow step % cannot depend on itself', bad.task_id
            USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on, c.id IS NULL AS no_step INTO bad
      FROM added AS a
      LEFT JOIN "worker".tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
      LEFT JOIN "worker".tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE c.id IS NULL OR p.id IS NULL
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: task % does not exist', bad.task_id, bad.depends_on,
            CASE WHEN bad.no_step THEN bad.task_id ELSE bad.depends_on END
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT a.task_id, a.depends_on, c.workflow_id AS c_wf, p.workflow_id AS p_wf INTO bad
      FROM added AS a
      JOIN "worker".tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
      JOIN "worker".tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE c.workflow_id IS NULL OR p.workflow_id IS DISTINCT FROM c.workflow_id
     LIMIT 1;
    IF FOUND THEN
        IF bad.c_wf IS NULL THEN
            RAISE EXCEPTION 'workflow edge % -> %: task % is not a workflow step (its workflow_id is NULL)',
                bad.task_id, bad.depends_on, bad.task_id USING ERRCODE = 'check_violation';
        END IF;
        RAISE EXCEPTION 'workflow edge % -> %: step % of workflow % cannot depend on task % of %',
            bad.task_id, bad.depends_on, bad.task_id, bad.c_wf, bad.depends_on,
            coalesce('workflow ' || bad.p_wf, 'no workflow') USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on INTO bad FROM added AS a WHERE a.depends_on > a.task_id LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: a step depends only on steps inserted before it (a lower id), which keeps a workflow free of cycles',
            bad.task_id, bad.depends_on USING ERRCODE = 'check_violation';
    END IF;
    -- Dependencies first, then the steps that wait, each in id order (as settle_steps locks).
    PERFORM 1 FROM "worker".tasks AS t
     WHERE t.id = ANY(parents) ORDER BY t.id FOR UPDATE;
    PERFORM 1 FROM "worker".tasks AS t
     WHERE t.id = ANY(kids) ORDER BY t.id FOR UPDATE;
    SELECT a.task_id, a.depends_on, c.state, c.dedupe_key IS NOT NULL AS keyed INTO bad
      FROM added AS a JOIN "worker".tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
     WHERE c.state NOT IN ('waiting', 'scheduled', 'queued') OR c.dedupe_key IS NOT NULL
     LIMIT 1;
    IF FOUND THEN
        IF bad.keyed THEN
            RAISE EXCEPTION 'workflow edge % -> %: step % has a dedupe key, which a step that waits for others cannot hold',
                bad.task_id, bad.depends_on, bad.task_id USING ERRCODE = 'check_violation';
        END IF;
        RAISE EXCEPTION 'workflow edge % -> %: step % is % already; add a step''s dependencies before it can run',
            bad.task_id, bad.depends_on, bad.task_id, bad.state USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on INTO bad
      FROM added AS a JOIN "worker".tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE p.state = 'in_progress' AND p.dependents IS NOT TRUE
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: step % is running, and was claimed without dependents; add dependencies on a step before it starts',
            bad.task_id, bad.depends_on, bad.depends_on USING ERRCODE = 'check_violation';
    END IF;
    -- Dependencies that finished already: settled now. Their edges are read by dependency, so
    -- that a producer adding a join's edges one statement at a time reads only the new ones.
    finished := ARRAY(SELECT p.id FROM "worker".tasks AS p
                       WHERE p.id = ANY(parents) AND p.state IN ('done', 'failed', 'cancelled'));
    IF cardinality(finished) > 0 THEN
        UPDATE "worker".task_deps AS d
           SET outcome = p.state::text, result = CASE WHEN p.state = 'done' THEN p.result END
          FROM added AS a JOIN "worker".tasks AS p ON p.id = a.depends_on AND p.id = ANY(finished)
         WHERE d.task_id = a.task_id AND d.depends_on = a.depends_on AND d.outcome IS NULL
           AND d.depends_on = ANY(finished);
    END IF;
    UPDATE "worker".tasks AS t SET dependents = true
     WHERE t.id = ANY(parents)
       AND t.state NOT IN ('done', 'failed', 'cancelled') AND t.dependents IS NOT TRUE;
    WITH c AS (
        SELECT a.task_id AS id,
               count(*) FILTER (WHERE p.state NOT IN ('done', 'failed', 'cancelled'))::integer AS n,
               min(a.depends_on) FILTER (WHERE p.state IN ('failed', 'cancelled')
                                           AND NOT a.run_on_failure) AS blocker
          FROM added AS a JOIN "worker".tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
         GROUP BY a.task_id
    ), moved AS (
        UPDATE "worker".tasks AS t
           SET pending_deps = coalesce(t.pending_deps, 0) + c.n,
               state = CASE WHEN c.blocker IS NOT NULL THEN 'cancelled'::"worker".task_state
                            WHEN coalesce(t.pending_deps, 0) + c.n > 0 THEN 'waiting'
                            WHEN t.state <> 'waiting' THEN t.state
                            WHEN t.run_at > now() THEN 'scheduled'
                            ELSE 'queued' END,
               finished_at = CASE WHEN c.blocker IS NOT NULL THEN now() ELSE t.finished_at END,
               cancelled_by = CASE WHEN c.blocker IS NOT NULL THEN 'workflow'
                                   ELSE t.cancelled_by END,
               last_error = CASE WHEN c.blocker IS NOT NULL
                                 THEN format('DependencyFailed: step %s ended before it was added',
                                             c.blocker)
                                 ELSE t.last_error END,
               inputs = CASE WHEN c.blocker IS NULL AND coalesce(t.pending_deps, 0) + c.n = 0 THEN (
                   SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                     FROM "worker".task_deps AS d WHERE d.task_id = t.id) END
          FROM c
         WHERE t.id = c.id AND t.id = ANY(kids)
        RETURNING t.id, t.state, t.dependents
    )
    SELECT coalesce(array_agg(m.id) FILTER (WHERE m.state = 'cancelled' AND m.dependents), '{}'),
           count(*) FILTER (WHERE m.state = 'queued')::integer
      INTO doomed, freed
      FROM moved AS m;
    IF cardinality(doomed) > 0 THEN
        PERFORM "worker".settle_steps(doomed);
    END IF;
    IF freed > 0 THEN
        PERFORM pg_notify(array_to_string(parse_ident('"worker".tasks'), '.'), '');
    END IF;
    RETURN NULL;
END;
$$;

-- Name: wake_steps(text[], timestamp with time zone); Type: FUNCTION; Schema: worker; Owner: -

CREATE FUNCTION worker.wake_steps(queues text[], earliest timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    AS $$
DECLARE
    names text;
BEGIN
    IF cardinality(queues) IS NULL OR cardinality(queues) = 0 THEN
        RETURN;
    END IF;
    names := array_to_string(ARRAY(SELECT DISTINCT q FROM unnest(queues) AS q LIMIT 50), ',');
    IF octet_length(names) > 7000 OR strpos(names, chr(30)) > 0 OR earliest IS NULL
       OR NOT isfinite(earliest)
       OR EXISTS (SELECT 1 FROM unnest(queues) AS q WHERE strpos(q, ',') > 0) THEN
        names := '';
    ELSE
        names := names || ',' || chr(30) || (extract(epoch FROM earliest) * 1000000)::bigint::text;
    END IF;
    PERFORM pg_notify(array_to_string(parse_ident('"worker".tasks'), '.'), names);
END;
$$;

-- Name: actions; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.actions (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    actor text NOT NULL,
    source text DEFAULT ''::text NOT NULL,
    action text NOT NULL,
    filter jsonb DEFAULT '{}'::jsonb NOT NULL,
    counts jsonb DEFAULT '{}'::jsonb NOT NULL,
    address text DEFAULT ''::text NOT NULL,
    interrupted text,
    CONSTRAINT actions_action_length CHECK (((char_length(action) >= 1) AND (char_length(action) <= 100))),
    CONSTRAINT actions_actor_length CHECK (((char_length(actor) >= 1) AND (char_length(actor) <= 200))),
    CONSTRAINT actions_address_length CHECK ((char_length(address) <= 100)),
    CONSTRAINT actions_interrupted_length CHECK (((char_length(interrupted) >= 1) AND (char_length(interrupted) <= 100))),
    CONSTRAINT actions_source_length CHECK ((char_length(source) <= 200))
);

-- Name: actions_id_seq; Type: SEQUENCE; Schema: worker; Owner: -

ALTER TABLE worker.actions ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME worker.actions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: cron_schedules; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.cron_schedules (
    key text NOT NULL,
    expr text NOT NULL,
    tz text DEFAULT 'UTC'::text NOT NULL,
    task text NOT NULL,
    queue text DEFAULT 'default'::text NOT NULL,
    catch_up text DEFAULT 'once'::text NOT NULL,
    last_slot timestamp with time zone,
    next_slot timestamp with time zone,
    declared_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT cron_schedules_catch_up_known CHECK ((catch_up = ANY (ARRAY['once'::text, 'skip'::text]))),
    CONSTRAINT cron_schedules_key_not_empty CHECK ((key <> ''::text))
);

-- Name: limit_permits; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.limit_permits (
    queue text NOT NULL,
    limit_key text DEFAULT ''::text NOT NULL,
    slot integer NOT NULL,
    task_id bigint,
    attempt integer,
    taken_by xid8
)
WITH (fillfactor='50', autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='2000');

-- Name: tasks; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.tasks (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    CONSTRAINT tasks_attempts_not_negative CHECK ((attempts >= 0)),
    CONSTRAINT tasks_cron_pair CHECK (((cron_key IS NULL) = (cron_at IS NULL))),
    CONSTRAINT tasks_lease_iff_running CHECK (((state = 'in_progress'::worker.task_state) = (lease_expires_at IS NOT NULL))),
    CONSTRAINT tasks_max_attempts_positive CHECK ((max_attempts >= 1)),
    CONSTRAINT tasks_priority_range CHECK (((priority >= '-1000000'::integer) AND (priority <= 1000000))),
    CONSTRAINT tasks_queue_not_empty CHECK ((queue <> ''::text)),
    CONSTRAINT tasks_task_not_empty CHECK ((task <> ''::text))
)
WITH (autovacuum_vacuum_scale_factor='0.0', autovacuum_vacuum_threshold='5000', autovacuum_vacuum_insert_scale_factor='0.0', autovacuum_vacuum_insert_threshold='20000', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_limit='2000');

-- Name: free_permits; Type: VIEW; Schema: worker; Owner: -

CREATE VIEW worker.free_permits AS
 SELECT queue,
    limit_key,
    slot
   FROM worker.limit_permits p
  WHERE ((task_id IS NULL) OR (((taken_by IS NULL) OR pg_visible_in_snapshot(taken_by, pg_current_snapshot())) AND (NOT COALESCE(( SELECT ((t.attempts = p.attempt) AND (t.state = 'in_progress'::worker.task_state) AND (t.lease_expires_at >= now()))
           FROM worker.tasks t
          WHERE (t.id = p.task_id)), false))));

-- Name: history_slots; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.history_slots (
    slot smallint NOT NULL,
    state text DEFAULT 'empty'::text NOT NULL,
    opened_at timestamp with time zone,
    closed_at timestamp with time zone,
    CONSTRAINT history_slots_slot CHECK (((slot >= 1) AND (slot <= 8))),
    CONSTRAINT history_slots_state CHECK ((state = ANY (ARRAY['current'::text, 'closed'::text, 'empty'::text]))),
    CONSTRAINT history_slots_times CHECK ((((state = 'current'::text) = (opened_at IS NOT NULL)) AND ((state = 'closed'::text) = (closed_at IS NOT NULL))))
);

-- Name: limit_rates; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.limit_rates (
    queue text NOT NULL,
    limit_key text DEFAULT ''::text NOT NULL,
    tat timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    window_start timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    window_starts integer DEFAULT 0 NOT NULL
);

-- Name: locks; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.locks (
    name text NOT NULL,
    holder text NOT NULL,
    kind text DEFAULT 'exclusive'::text NOT NULL,
    acquired_at timestamp with time zone DEFAULT now() NOT NULL,
    renewed_at timestamp with time zone DEFAULT now() NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    CONSTRAINT locks_holder_not_empty CHECK ((holder <> ''::text)),
    CONSTRAINT locks_kind_known CHECK ((kind = ANY (ARRAY['exclusive'::text, 'mutex'::text, 'timeout'::text]))),
    CONSTRAINT locks_name_length CHECK (((char_length(name) >= 1) AND (char_length(name) <= 255)))
);

-- Name: paused_queues; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.paused_queues (
    queue text NOT NULL,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    paused_by text DEFAULT ''::text NOT NULL,
    CONSTRAINT paused_queues_by_length CHECK ((char_length(paused_by) <= 200)),
    CONSTRAINT paused_queues_queue_length CHECK (((queue <> ''::text) AND (char_length(queue) <= 255)))
);

-- Name: queue_limits; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.queue_limits (
    queue text NOT NULL,
    concurrency integer,
    key_concurrency integer,
    rate integer,
    rate_seconds double precision,
    key_rate integer,
    key_rate_seconds double precision,
    source text DEFAULT 'operator'::text NOT NULL,
    updated_by text DEFAULT CURRENT_USER NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    burst integer,
    key_burst integer,
    CONSTRAINT queue_limits_burst CHECK (((burst >= 1) AND (key_burst >= 1))),
    CONSTRAINT queue_limits_concurrency CHECK (((concurrency >= 0) AND (key_concurrency >= 0))),
    CONSTRAINT queue_limits_key_rate CHECK ((((key_rate IS NULL) = (key_rate_seconds IS NULL)) AND (key_rate >= 1) AND (key_rate_seconds > (0)::double precision) AND (key_rate_seconds <= (31622400)::double precision))),
    CONSTRAINT queue_limits_queue CHECK (((queue <> ''::text) AND (char_length(queue) <= 255))),
    CONSTRAINT queue_limits_rate CHECK ((((rate IS NULL) = (rate_seconds IS NULL)) AND (rate >= 1) AND (rate_seconds > (0)::double precision) AND (rate_seconds <= (31622400)::double precision))),
    CONSTRAINT queue_limits_some CHECK ((num_nonnulls(concurrency, key_concurrency, rate, key_rate) > 0)),
    CONSTRAINT queue_limits_source CHECK ((source = ANY (ARRAY['code'::text, 'operator'::text])))
);

-- Name: queue_minutes; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.queue_minutes (
    minute timestamp with time zone NOT NULL,
    queue text NOT NULL,
    queued bigint DEFAULT 0 NOT NULL,
    in_progress bigint DEFAULT 0 NOT NULL,
    waited integer DEFAULT 0 NOT NULL,
    wait_p50 double precision,
    wait_p99 double precision
);

-- Name: schema_migrations; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    complete boolean DEFAULT true NOT NULL
);

-- Name: stats_minutes; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.stats_minutes (
    minute timestamp with time zone NOT NULL,
    sampled_at timestamp with time zone DEFAULT now() NOT NULL,
    queued bigint DEFAULT 0 NOT NULL,
    queued_capped boolean DEFAULT false NOT NULL,
    in_progress bigint DEFAULT 0 NOT NULL
);

-- Name: task_deps; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_deps (
    task_id bigint NOT NULL,
    depends_on bigint NOT NULL,
    run_on_failure boolean DEFAULT false NOT NULL,
    "position" integer DEFAULT 0 NOT NULL,
    outcome text,
    result jsonb,
    CONSTRAINT task_deps_outcome_known CHECK ((outcome = ANY (ARRAY['done'::text, 'failed'::text, 'cancelled'::text])))
)
WITH (fillfactor='50');

-- Name: task_history; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
PARTITION BY LIST (slot);

-- Name: task_history_1; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_1 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_2; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_2 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_3; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_3 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_4; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_4 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_5; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_5 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_6; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_6 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_7; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_7 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_history_8; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_history_8 (
    id bigint NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    priority integer DEFAULT 0 NOT NULL,
    run_at timestamp with time zone DEFAULT now() NOT NULL,
    state worker.task_state DEFAULT 'queued'::worker.task_state NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    last_error text,
    dedupe_key text,
    cron_key text,
    cron_at timestamp with time zone,
    worker_id uuid,
    lease_expires_at timestamp with time zone,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    handed_back integer DEFAULT 0 NOT NULL,
    errors jsonb,
    cancel_requested_at timestamp with time zone,
    cancelled_by text,
    result jsonb,
    trace_context jsonb,
    limit_key text,
    limit_held boolean,
    workflow_id bigint,
    pending_deps integer,
    dependents boolean,
    inputs jsonb,
    slot smallint NOT NULL
)
WITH (autovacuum_vacuum_insert_threshold='-1');

-- Name: task_routes; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.task_routes (
    task text NOT NULL,
    queue text NOT NULL,
    declared_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT task_routes_queue_length CHECK (((char_length(queue) >= 1) AND (char_length(queue) <= 255))),
    CONSTRAINT task_routes_task_length CHECK (((char_length(task) >= 1) AND (char_length(task) <= 255)))
);

-- Name: task_rows; Type: VIEW; Schema: worker; Owner: -

CREATE VIEW worker.task_rows AS
 SELECT tasks.id,
    tasks.queue,
    tasks.task,
    tasks.payload,
    tasks.priority,
    tasks.run_at,
    tasks.state,
    tasks.attempts,
    tasks.max_attempts,
    tasks.last_error,
    tasks.dedupe_key,
    tasks.cron_key,
    tasks.cron_at,
    tasks.worker_id,
    tasks.lease_expires_at,
    tasks.created_at,
    tasks.started_at,
    tasks.finished_at,
    tasks.handed_back,
    tasks.errors,
    tasks.cancel_requested_at,
    tasks.cancelled_by,
    tasks.result,
    tasks.trace_context,
    tasks.limit_key,
    tasks.limit_held,
    tasks.workflow_id,
    tasks.pending_deps,
    tasks.dependents,
    tasks.inputs
   FROM worker.tasks
UNION ALL
 SELECT task_history.id,
    task_history.queue,
    task_history.task,
    task_history.payload,
    task_history.priority,
    task_history.run_at,
    task_history.state,
    task_history.attempts,
    task_history.max_attempts,
    task_history.last_error,
    task_history.dedupe_key,
    task_history.cron_key,
    task_history.cron_at,
    task_history.worker_id,
    task_history.lease_expires_at,
    task_history.created_at,
    task_history.started_at,
    task_history.finished_at,
    task_history.handed_back,
    task_history.errors,
    task_history.cancel_requested_at,
    task_history.cancelled_by,
    task_history.result,
    task_history.trace_context,
    task_history.limit_key,
    task_history.limit_held,
    task_history.workflow_id,
    task_history.pending_deps,
    task_history.dependents,
    task_history.inputs
   FROM worker.task_history;

-- Name: tasks_id_seq; Type: SEQUENCE; Schema: worker; Owner: -

ALTER TABLE worker.tasks ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (
    SEQUENCE NAME worker.tasks_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: workers; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.workers (
    id uuid NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    queues text[] NOT NULL,
    concurrency integer NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    in_flight integer DEFAULT 0 NOT NULL,
    stopped_at timestamp with time zone,
    tasks text[] DEFAULT '{}'::text[] NOT NULL
);

-- Name: workflows; Type: TABLE; Schema: worker; Owner: -

CREATE TABLE worker.workflows (
    id bigint NOT NULL,
    name text DEFAULT ''::text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT workflows_name_length CHECK ((char_length(name) <= 255))
);

-- Name: workflows_id_seq; Type: SEQUENCE; Schema: worker; Owner: -

ALTER TABLE worker.workflows ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (
    SEQUENCE NAME worker.workflows_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: task_history_1; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_1 FOR VALUES IN ('1');

-- Name: task_history_2; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_2 FOR VALUES IN ('2');

-- Name: task_history_3; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_3 FOR VALUES IN ('3');

-- Name: task_history_4; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_4 FOR VALUES IN ('4');

-- Name: task_history_5; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_5 FOR VALUES IN ('5');

-- Name: task_history_6; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_6 FOR VALUES IN ('6');

-- Name: task_history_7; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_7 FOR VALUES IN ('7');

-- Name: task_history_8; Type: TABLE ATTACH; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history ATTACH PARTITION worker.task_history_8 FOR VALUES IN ('8');

-- Name: actions actions_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.actions
    ADD CONSTRAINT actions_pkey PRIMARY KEY (id);

-- Name: cron_schedules cron_schedules_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.cron_schedules
    ADD CONSTRAINT cron_schedules_pkey PRIMARY KEY (key);

-- Name: history_slots history_slots_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.history_slots
    ADD CONSTRAINT history_slots_pkey PRIMARY KEY (slot);

-- Name: limit_permits limit_permits_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.limit_permits
    ADD CONSTRAINT limit_permits_pkey PRIMARY KEY (queue, limit_key, slot);

-- Name: limit_rates limit_rates_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.limit_rates
    ADD CONSTRAINT limit_rates_pkey PRIMARY KEY (queue, limit_key);

-- Name: locks locks_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.locks
    ADD CONSTRAINT locks_pkey PRIMARY KEY (name);

-- Name: paused_queues paused_queues_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.paused_queues
    ADD CONSTRAINT paused_queues_pkey PRIMARY KEY (queue);

-- Name: queue_limits queue_limits_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.queue_limits
    ADD CONSTRAINT queue_limits_pkey PRIMARY KEY (queue);

-- Name: queue_minutes queue_minutes_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.queue_minutes
    ADD CONSTRAINT queue_minutes_pkey PRIMARY KEY (minute, queue);

-- Name: schema_migrations schema_migrations_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

-- Name: stats_minutes stats_minutes_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.stats_minutes
    ADD CONSTRAINT stats_minutes_pkey PRIMARY KEY (minute);

-- Name: task_deps task_deps_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_deps
    ADD CONSTRAINT task_deps_pkey PRIMARY KEY (task_id, depends_on);

-- Name: task_history task_history_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history
    ADD CONSTRAINT task_history_pkey PRIMARY KEY (id, slot);

-- Name: task_history_1 task_history_1_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_1
    ADD CONSTRAINT task_history_1_pkey PRIMARY KEY (id, slot);

-- Name: task_history_2 task_history_2_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_2
    ADD CONSTRAINT task_history_2_pkey PRIMARY KEY (id, slot);

-- Name: task_history_3 task_history_3_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_3
    ADD CONSTRAINT task_history_3_pkey PRIMARY KEY (id, slot);

-- Name: task_history_4 task_history_4_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_4
    ADD CONSTRAINT task_history_4_pkey PRIMARY KEY (id, slot);

-- Name: task_history_5 task_history_5_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_5
    ADD CONSTRAINT task_history_5_pkey PRIMARY KEY (id, slot);

-- Name: task_history_6 task_history_6_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_6
    ADD CONSTRAINT task_history_6_pkey PRIMARY KEY (id, slot);

-- Name: task_history_7 task_history_7_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_7
    ADD CONSTRAINT task_history_7_pkey PRIMARY KEY (id, slot);

-- Name: task_history_8 task_history_8_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_history_8
    ADD CONSTRAINT task_history_8_pkey PRIMARY KEY (id, slot);

-- Name: task_routes task_routes_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.task_routes
    ADD CONSTRAINT task_routes_pkey PRIMARY KEY (task);

-- Name: tasks tasks_created_at_finite; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_created_at_finite CHECK (isfinite(created_at)) NOT VALID;

-- Name: tasks tasks_dedupe_key_length; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_dedupe_key_length CHECK ((char_length(dedupe_key) <= 1000)) NOT VALID;

-- Name: tasks tasks_limit_key_length; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_limit_key_length CHECK ((char_length(limit_key) <= 255)) NOT VALID;

-- Name: tasks tasks_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.tasks
    ADD CONSTRAINT tasks_pkey PRIMARY KEY (id);

-- Name: tasks tasks_queue_length; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_queue_length CHECK ((char_length(queue) <= 255)) NOT VALID;

-- Name: tasks tasks_run_at_finite; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_run_at_finite CHECK (isfinite(run_at)) NOT VALID;

-- Name: tasks tasks_task_length; Type: CHECK CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE worker.tasks
    ADD CONSTRAINT tasks_task_length CHECK ((char_length(task) <= 255)) NOT VALID;

-- Name: workers workers_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.workers
    ADD CONSTRAINT workers_pkey PRIMARY KEY (id);

-- Name: workflows workflows_pkey; Type: CONSTRAINT; Schema: worker; Owner: -

ALTER TABLE ONLY worker.workflows
    ADD CONSTRAINT workflows_pkey PRIMARY KEY (id);

-- Name: actions_at_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX actions_at_idx ON worker.actions USING btree (at);

-- Name: history_slots_current_idx; Type: INDEX; Schema: worker; Owner: -

CREATE UNIQUE INDEX history_slots_current_idx ON worker.history_slots USING btree ((true)) WHERE (state = 'current'::text);

-- Name: task_deps_depends_on_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_deps_depends_on_idx ON worker.task_deps USING btree (depends_on);

-- Name: task_history_finished_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_finished_idx ON ONLY worker.task_history USING btree (finished_at, id);

-- Name: task_history_1_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_1_finished_at_id_idx ON worker.task_history_1 USING btree (finished_at, id);

-- Name: task_history_2_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_2_finished_at_id_idx ON worker.task_history_2 USING btree (finished_at, id);

-- Name: task_history_3_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_3_finished_at_id_idx ON worker.task_history_3 USING btree (finished_at, id);

-- Name: task_history_4_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_4_finished_at_id_idx ON worker.task_history_4 USING btree (finished_at, id);

-- Name: task_history_5_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_5_finished_at_id_idx ON worker.task_history_5 USING btree (finished_at, id);

-- Name: task_history_6_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_6_finished_at_id_idx ON worker.task_history_6 USING btree (finished_at, id);

-- Name: task_history_7_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_7_finished_at_id_idx ON worker.task_history_7 USING btree (finished_at, id);

-- Name: task_history_8_finished_at_id_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX task_history_8_finished_at_id_idx ON worker.task_history_8 USING btree (finished_at, id);

-- Name: tasks_claim_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_claim_idx ON worker.tasks USING btree (queue, ((- priority)), run_at, id) WHERE (state = 'queued'::worker.task_state);

-- Name: tasks_cron_slot_idx; Type: INDEX; Schema: worker; Owner: -

CREATE UNIQUE INDEX tasks_cron_slot_idx ON worker.tasks USING btree (cron_key, cron_at) WHERE (cron_key IS NOT NULL);

-- Name: tasks_dedupe_idx; Type: INDEX; Schema: worker; Owner: -

CREATE UNIQUE INDEX tasks_dedupe_idx ON worker.tasks USING btree (dedupe_key) WHERE ((dedupe_key IS NOT NULL) AND (state = ANY (ARRAY['scheduled'::worker.task_state, 'queued'::worker.task_state, 'in_progress'::worker.task_state])));

-- Name: tasks_done_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_done_idx ON worker.tasks USING btree (finished_at) WHERE (state = ANY (ARRAY['done'::worker.task_state, 'cancelled'::worker.task_state]));

-- Name: tasks_failed_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_failed_idx ON worker.tasks USING btree (finished_at, id) WHERE (state = 'failed'::worker.task_state);

-- Name: tasks_failed_queue_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_failed_queue_idx ON worker.tasks USING btree (queue, finished_at, id) WHERE (state = 'failed'::worker.task_state);

-- Name: tasks_handed_back_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_handed_back_idx ON worker.tasks USING btree ("left"(task, 255)) WHERE ((handed_back > 0) AND (state = 'scheduled'::worker.task_state));

-- Name: tasks_lease_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_lease_idx ON worker.tasks USING btree (lease_expires_at) WHERE (state = 'in_progress'::worker.task_state);

-- Name: tasks_limit_key_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_limit_key_idx ON worker.tasks USING btree (queue, limit_key, ((- priority)), run_at, id) WHERE ((state = 'queued'::worker.task_state) AND (limit_key IS NOT NULL));

-- Name: tasks_limit_running_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_limit_running_idx ON worker.tasks USING btree (queue, limit_key) WHERE ((state = 'in_progress'::worker.task_state) AND limit_held);

-- Name: tasks_scheduled_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_scheduled_idx ON worker.tasks USING btree (run_at) WHERE (state = 'scheduled'::worker.task_state);

-- Name: tasks_scheduled_queue_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_scheduled_queue_idx ON worker.tasks USING btree (queue, run_at) WHERE (state = 'scheduled'::worker.task_state);

-- Name: tasks_unsettled_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_unsettled_idx ON worker.tasks USING btree (id) WHERE (dependents AND (state = ANY (ARRAY['done'::worker.task_state, 'failed'::worker.task_state, 'cancelled'::worker.task_state])));

-- Name: tasks_waiting_free_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_waiting_free_idx ON worker.tasks USING btree (id) WHERE ((state = 'waiting'::worker.task_state) AND (COALESCE(pending_deps, 0) <= 0));

-- Name: tasks_workflow_idx; Type: INDEX; Schema: worker; Owner: -

CREATE INDEX tasks_workflow_idx ON worker.tasks USING btree (workflow_id, id) WHERE (workflow_id IS NOT NULL);

-- Name: task_history_1_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_1_finished_at_id_idx;

-- Name: task_history_1_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_1_pkey;

-- Name: task_history_2_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_2_finished_at_id_idx;

-- Name: task_history_2_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_2_pkey;

-- Name: task_history_3_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_3_finished_at_id_idx;

-- Name: task_history_3_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_3_pkey;

-- Name: task_history_4_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_4_finished_at_id_idx;

-- Name: task_history_4_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_4_pkey;

-- Name: task_history_5_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_5_finished_at_id_idx;

-- Name: task_history_5_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_5_pkey;

-- Name: task_history_6_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_6_finished_at_id_idx;

-- Name: task_history_6_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_6_pkey;

-- Name: task_history_7_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_7_finished_at_id_idx;

-- Name: task_history_7_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_7_pkey;

-- Name: task_history_8_finished_at_id_idx; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_finished_idx ATTACH PARTITION worker.task_history_8_finished_at_id_idx;

-- Name: task_history_8_pkey; Type: INDEX ATTACH; Schema: worker; Owner: -

ALTER INDEX worker.task_history_pkey ATTACH PARTITION worker.task_history_8_pkey;

-- Name: tasks_queue_state; Type: STATISTICS; Schema: worker; Owner: -

CREATE STATISTICS worker.tasks_queue_state (mcv) ON queue, state FROM worker.tasks;

-- Name: task_deps task_deps_added; Type: TRIGGER; Schema: worker; Owner: -

CREATE TRIGGER task_deps_added AFTER INSERT ON worker.task_deps REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION worker.task_deps_added();

-- Name: tasks tasks_before_insert; Type: TRIGGER; Schema: worker; Owner: -

CREATE TRIGGER tasks_before_insert BEFORE INSERT ON worker.tasks FOR EACH ROW WHEN (((new.queue IS NULL) OR ((new.state = 'queued'::worker.task_state) AND (new.run_at > now())))) EXECUTE FUNCTION worker.before_insert();

-- Name: tasks tasks_notify_inserted; Type: TRIGGER; Schema: worker; Owner: -

CREATE TRIGGER tasks_notify_inserted AFTER INSERT ON worker.tasks REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION worker.notify_inserted();
