-- 0030: the planner's estimate of a queue's done rows counts the history too.
--
-- `worker status` shows the planner's estimate where a count stopped at its cap (`done ≈…`).
-- estimated_rows (schema/0007) planned a read of `tasks` alone, so with the history kept
-- (`worker run --keep-history`, schema/0025), where done tasks leave `tasks`, millions of done
-- tasks showed as `≥10,000`. For state 'done' (the only state the history holds) it now adds the
-- estimate of each history slot that autovacuum's analyze found rows in, from that slot's own
-- statistics. A slot's estimate of one row is left out: that is the planner's floor for "none"
-- (an estimate is never below one row), and eight of them would make a queue with no done
-- tasks show `≈8`. Still nothing is executed.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.estimated_rows(queue text, state text) RETURNS float8
LANGUAGE plpgsql AS $$
DECLARE
    plan  json;
    total float8;
    part  regclass;
    rows  float8;
BEGIN
    EXECUTE format('EXPLAIN (FORMAT JSON) SELECT 1 FROM {schema}.tasks WHERE queue = %L AND state = %L',
                   queue, state)
       INTO plan;
    total := (plan -> 0 -> 'Plan' ->> 'Plan Rows')::float8;
    IF state = 'done' THEN
        FOR part IN SELECT c.oid::regclass
                      FROM pg_inherits AS i
                      JOIN pg_class AS c ON c.oid = i.inhrelid
                     WHERE i.inhparent = '{schema}.task_history'::regclass AND c.reltuples > 0
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
