-- 0013: the producer's trace context, stored with its row (see worker/contrib/otel.py).
--
-- A nullable column without a default: a change to the catalog only, no rewrite of the table.
-- Only a producer with tracing on (worker.contrib.otel.instrument()) writes it, as the W3C
-- carrier {"traceparent": ..., "tracestate": ...}; a plain INSERT, worker.enqueue() in SQL, the
-- CLI or Python without the extra leave it NULL, and such a row runs as before. The claim returns
-- it as text with the claimed rows (same statement, no extra round trip); a worker without the
-- extra ignores it.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.tasks ADD COLUMN trace_context jsonb;

COMMENT ON COLUMN {schema}.tasks.trace_context IS
    'the producer''s trace context (W3C traceparent/tracestate), written by traced producers only';

-- enqueue() takes the context as an eighth, optional argument. A new signature is a new function,
-- and two enqueue() overloads that differ only by a defaulted argument make every call ambiguous,
-- so the old one is replaced: the grants on it (deploy/sql/roles.sql, or an operator's own) are
-- carried over to the new one, PUBLIC's included (a REVOKE from PUBLIC stays revoked).
DO $do$
DECLARE
    old_acl aclitem[];
    owner_oid oid;
    g record;
BEGIN
    SELECT p.proacl, p.proowner INTO old_acl, owner_oid
      FROM pg_proc AS p
     WHERE p.oid = to_regprocedure(
        '{schema}.enqueue(text, jsonb, text, timestamptz, integer, integer, text)');

    DROP FUNCTION {schema}.enqueue(text, jsonb, text, timestamptz, integer, integer, text);

    -- As in 0006, with trace_context written on insert only: a dedupe hit keeps the context of
    -- the producer that created the task.
    CREATE FUNCTION {schema}.enqueue(
        task          text,
        payload       jsonb       DEFAULT '{}',
        queue         text        DEFAULT NULL,
        run_at        timestamptz DEFAULT now(),
        priority      integer     DEFAULT 0,
        max_attempts  integer     DEFAULT NULL,
        dedupe_key    text        DEFAULT NULL,
        trace_context jsonb       DEFAULT NULL
    ) RETURNS bigint
    LANGUAGE plpgsql AS $fn$
    #variable_conflict use_column
    DECLARE
        new_id bigint;
    BEGIN
        FOR i IN 1..10 LOOP
            IF enqueue.dedupe_key IS NOT NULL THEN
                SELECT t.id INTO new_id FROM {schema}.tasks AS t
                 WHERE t.dedupe_key = enqueue.dedupe_key
                   AND t.state IN ('scheduled', 'queued', 'in_progress');
                IF new_id IS NOT NULL THEN
                    RETURN new_id;
                END IF;
            END IF;
            INSERT INTO {schema}.tasks AS t
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
    $fn$;

    IF old_acl IS NOT NULL THEN  -- NULL: never granted or revoked, the defaults apply as before
        REVOKE ALL ON FUNCTION
            {schema}.enqueue(text, jsonb, text, timestamptz, integer, integer, text, jsonb)
            FROM PUBLIC;
        FOR g IN SELECT a.grantee, a.privilege_type, a.is_grantable
                   FROM aclexplode(old_acl) AS a
                  WHERE a.grantee <> owner_oid LOOP
            EXECUTE format(
                'GRANT %s ON FUNCTION {schema}.enqueue(text, jsonb, text, timestamptz, integer, '
                'integer, text, jsonb) TO %s%s',
                g.privilege_type,
                CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
                CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END IF;
END;
$do$;
