-- 0018: operator actions that say how they ended, and limits the database refuses when they are
-- out of range.
--
--   * `actions.interrupted`: an action stopped between two batches (SIGINT, SIGTERM) is recorded
--     with `finished_at` and the signal that stopped it; its counts are the rows its committed
--     batches changed. NULL for an action that ran to its end. `finish_action` takes it, and keeps
--     the recorded counts when given none.
--   * `set_queue_limit` checks every value before it writes, with one message per mistake, for
--     SQL callers as for the CLI (which checks the same in Python first): counts as bigint, so a
--     number too large for the table is named rather than "function does not exist"; a rate of 0
--     (which made every claim of its workers divide by zero) is refused, as is a burst or a
--     period without its rate. Rows a rate of 0 was set on hold their queue (or keys) with a
--     concurrency of 0 instead, which is what they asked for and what claims can run.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.actions ADD COLUMN interrupted text;
ALTER TABLE {schema}.actions
    ADD CONSTRAINT actions_interrupted_length CHECK (char_length(interrupted) BETWEEN 1 AND 100);

DROP FUNCTION {schema}.finish_action(bigint, jsonb, boolean);

-- The counts of a recorded action (NULL: keep those recorded), and how it ended: finished (its
-- time set), interrupted by `interrupted` (a signal's name: finished at that time too, between two
-- batches), or not finished (NULL: running, or a process that died without a word).
CREATE FUNCTION {schema}.finish_action(
    action_id   bigint,
    counts      jsonb,
    finished    boolean DEFAULT true,
    interrupted text    DEFAULT NULL
) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.actions AS a
       SET counts = coalesce(finish_action.counts, a.counts, '{}'),
           finished_at = CASE WHEN finish_action.finished OR finish_action.interrupted IS NOT NULL
                              THEN now() END,
           interrupted = left(nullif(finish_action.interrupted, ''), 100)
     WHERE a.id = finish_action.action_id;
$$;

-- Rates of 0 become what they meant: nothing starts.
UPDATE {schema}.queue_limits
   SET concurrency = 0, rate = NULL, rate_seconds = NULL, burst = NULL
 WHERE rate = 0;
UPDATE {schema}.queue_limits
   SET key_concurrency = 0, key_rate = NULL, key_rate_seconds = NULL, key_burst = NULL
 WHERE key_rate = 0;

ALTER TABLE {schema}.queue_limits
    DROP CONSTRAINT queue_limits_rate,
    DROP CONSTRAINT queue_limits_key_rate,
    ADD CONSTRAINT queue_limits_rate CHECK (
        (rate IS NULL) = (rate_seconds IS NULL) AND rate >= 1
        AND rate_seconds > 0 AND rate_seconds <= 31622400),
    ADD CONSTRAINT queue_limits_key_rate CHECK (
        (key_rate IS NULL) = (key_rate_seconds IS NULL) AND key_rate >= 1
        AND key_rate_seconds > 0 AND key_rate_seconds <= 31622400);

SELECT {schema}.sync_limit_permits(l.queue) FROM {schema}.queue_limits AS l;

DROP FUNCTION {schema}.set_queue_limit(text, integer, integer, integer, double precision,
                                       integer, double precision, text, text, integer, integer);

-- Operators (and the CLI, which calls it): set or change a queue's limits, every one at once (a
-- NULL is no such limit). Effective for the next claim of that queue. Ranges, as worker/tasks/
-- limits.py checks them first:
--   concurrency, key_concurrency: 0 to 100000 running (0: nothing starts);
--   rate, key_rate: 1 to 1000000000 starts per rate_seconds (default 1), a period of more than
--     0 s up to a year (31622400 s), at most 1000000 starts a second;
--   burst, key_burst: 1 to 100000 starts at once, only with their rate (default 1: evenly spaced).
-- A value out of range raises invalid_parameter_value (22023) naming the parameter.
CREATE FUNCTION {schema}.set_queue_limit(
    queue text,
    concurrency bigint DEFAULT NULL,
    key_concurrency bigint DEFAULT NULL,
    rate bigint DEFAULT NULL,
    rate_seconds double precision DEFAULT NULL,
    key_rate bigint DEFAULT NULL,
    key_rate_seconds double precision DEFAULT NULL,
    source text DEFAULT 'operator',
    updated_by text DEFAULT current_user,
    burst bigint DEFAULT NULL,
    key_burst bigint DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
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
    INSERT INTO {schema}.queue_limits AS l
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
    PERFORM {schema}.sync_limit_permits(queue);
    RETURN changed;
END;
$$;
