-- 0029: a bulk cancel settles the workflow steps it cancels.
--
-- `worker cancel --state ...` (and the console's bulk cancel) ended scheduled and queued rows
-- with a statement of its own, and the steps that waited for a workflow step it cancelled stayed
-- waiting until the next maintenance pass cancelled them. Each batch now settles the steps it
-- cancelled before it commits, as a cancel by id does (cancel_tasks, schema/0022): their
-- dependents end cancelled with them (or run, for run_on_failure edges), in the same transaction.
-- The function is otherwise as in schema/0008.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.bulk_step(
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
    IF action = 'cancel' AND changed > 0 AND NOT dry_run THEN
        -- Workflow steps this batch cancelled: the steps that wait for them are cancelled too,
        -- in this transaction, as cancel_tasks does (their finished_at is this transaction's).
        PERFORM {schema}.settle_steps(ARRAY(
            SELECT t.id FROM {schema}.tasks AS t
             WHERE t.dependents AND t.state IN ('done', 'failed', 'cancelled')
               AND t.state = 'cancelled' AND t.finished_at = now()));
    END IF;
    RETURN NEXT;
END;
$$;
