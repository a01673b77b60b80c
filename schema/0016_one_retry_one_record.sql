-- 0016: one retry, one record of operator actions.
--
-- Every way back to the queue (one task by id, many by id from the console, every failure of a
-- queue, a bulk retry by filter from the CLI, the console or psql) goes through one function,
-- `requeue`, with one dedupe check. The console's actions are recorded in `actions` with every
-- other operator action: `console_audit` is folded into it (its rows are kept) and dropped.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- Failed or cancelled tasks among `ids` back to queued: due now, attempts 0, no finish time, no
-- lease, no cancel request (a new run must not be stopped by the old one's). A task whose dedupe
-- key a scheduled, queued or running task holds stays as it is, as does every task of the batch
-- but the oldest failure that share one key; those are returned in `skipped`. Tasks in another
-- state (or missing) are in neither list. `dry_run`: the same answer, nothing changed. Idle
-- workers are woken when anything was requeued. A producer that takes a key between the check
-- and the update raises a unique violation inside; the batch then runs again and sees that task.
CREATE FUNCTION {schema}.requeue(ids bigint[], dry_run boolean DEFAULT false)
RETURNS TABLE (requeued bigint[], skipped bigint[])
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    tries integer := 0;
BEGIN
    LOOP
        BEGIN
            WITH batch AS (
                SELECT t.id, t.finished_at, t.dedupe_key
                  FROM {schema}.tasks AS t
                 WHERE t.id = ANY(ids) AND t.state IN ('failed', 'cancelled')
                 ORDER BY t.id
                   FOR UPDATE
            ), checked AS (
                SELECT b.id,
                       b.dedupe_key IS NOT NULL
                       AND (row_number() OVER (PARTITION BY b.dedupe_key
                                               ORDER BY b.finished_at, b.id) > 1
                            OR EXISTS (SELECT 1 FROM {schema}.tasks AS h
                                        WHERE h.dedupe_key = b.dedupe_key
                                          AND h.state IN ('scheduled', 'queued', 'in_progress')))
                       AS taken
                  FROM batch AS b
            ), moved AS (
                UPDATE {schema}.tasks AS t
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
        PERFORM pg_notify(array_to_string(parse_ident('{schema}.tasks'), '.'), '');
    END IF;
    RETURN NEXT;
END;
$$;

-- Bulk retries (schema/0008) go through requeue too: the statement of one batch asks it about
-- the batch's matches instead of carrying a copy of the dedupe check and the update.
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
        ')%s, checked AS ('
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
        hit_where, req, taken, act, phase,
        CASE WHEN finished THEN 'w.finished_at' ELSE 'w.run_at' END,
        (SELECT string_agg(regexp_replace(k, '([a-z_]+)', 'w.\1') || ' DESC', ', ')
           FROM unnest(keys) AS k));
END;
$$;

-- One record of operator actions: where an action came from (an address, for the console) joins
-- who, what and how many; the console's audit rows move over with it.
ALTER TABLE {schema}.actions ADD COLUMN address text NOT NULL DEFAULT '';
ALTER TABLE {schema}.actions
    ADD CONSTRAINT actions_address_length CHECK (char_length(address) <= 100);

INSERT INTO {schema}.actions (at, finished_at, actor, source, address, action, filter, counts)
SELECT a.at, a.at, left(coalesce(nullif(a.actor, ''), 'unknown'), 200), 'console',
       left(a.address, 100), left(coalesce(nullif(a.action, ''), 'unknown'), 100), a.target,
       jsonb_build_object('changed', a.affected)
  FROM {schema}.console_audit AS a
 ORDER BY a.id;

DROP TABLE {schema}.console_audit;

DROP FUNCTION {schema}.record_action(text, text, jsonb, jsonb, text, boolean);

CREATE FUNCTION {schema}.record_action(
    actor    text,
    action   text,
    filter   jsonb   DEFAULT '{}',
    counts   jsonb   DEFAULT '{}',
    source   text    DEFAULT '',
    finished boolean DEFAULT true,
    address  text    DEFAULT ''
) RETURNS bigint
LANGUAGE sql AS $$
    INSERT INTO {schema}.actions (actor, action, filter, counts, source, finished_at, address)
    VALUES (left(coalesce(nullif(actor, ''), session_user::text), 200), left(action, 100),
            coalesce(filter, '{}'), coalesce(counts, '{}'), left(coalesce(source, ''), 200),
            CASE WHEN finished THEN now() END, left(coalesce(address, ''), 100))
    RETURNING id;
$$;
