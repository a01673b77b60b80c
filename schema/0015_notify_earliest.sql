-- 0015: a notification for new rows also says how far back the earliest of them sits.
--
-- Each worker reads a queue from a little before where its last claim stopped (see ClaimCursor
-- in worker/_transitions.py), so that it does not walk the dead index entries of the rows it
-- already claimed. A row that becomes visible further back than that (a producer transaction
-- that committed long after it began, an explicit run_at in the past) used to wait for a probe
-- that walks those dead entries, run every second or so. The notification now ends with the
-- earliest run_at of the rows it announces, in microseconds since the epoch, after a comma and
-- the record separator character (U+001E): "mail,reports,\x1e1764000000123456". A worker whose
-- cursor is past that time reads the queue from its start once; the probe can then run seldom.
-- Workers of earlier versions split the payload on commas and ignore the part they do not
-- recognise as a queue, so they keep working during a rolling upgrade.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.notify_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
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
