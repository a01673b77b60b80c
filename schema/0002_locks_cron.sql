-- 0002: lock rows (exclusive jobs, mutexes, timeout locks) and what the cron ticker knows about
-- its schedules.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- One row per lock name. A lock is free when its row is missing or expired; taking it is a single
-- upsert that only overwrites a free row (or one the same holder already has), so the database
-- decides the winner and no client-side check-then-write race exists. Expiry is computed by the
-- database clock, so the holders' own clocks never have to agree.
CREATE TABLE {schema}.locks (
    name        text        PRIMARY KEY,
    -- Who holds it: an opaque id chosen by the client (by default host:pid:random per lock object).
    holder      text        NOT NULL,
    -- 'exclusive' (expires, extended while working), 'mutex' (never expires), 'timeout'
    -- (expires, not re-entrant). All share one namespace of names.
    kind        text        NOT NULL DEFAULT 'exclusive',
    acquired_at timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now(),
    -- 'infinity' for a mutex: it is free only once released (or force-released by an operator).
    expires_at  timestamptz NOT NULL,
    CONSTRAINT locks_name_length CHECK (char_length(name) BETWEEN 1 AND 255),
    CONSTRAINT locks_holder_not_empty CHECK (holder <> ''),
    CONSTRAINT locks_kind_known CHECK (kind IN ('exclusive', 'mutex', 'timeout'))
);

-- Schedules as the cron ticker of the worker processes declared them, so that `worker cron` and a
-- status page can show them without importing the application's code. The tasks table stays the
-- authority on which slots were enqueued (tasks_cron_slot_idx); this table is a summary.
CREATE TABLE {schema}.cron_schedules (
    key         text        PRIMARY KEY,
    expr        text        NOT NULL,
    tz          text        NOT NULL DEFAULT 'UTC',
    task        text        NOT NULL,
    queue       text        NOT NULL DEFAULT 'default',
    catch_up    text        NOT NULL DEFAULT 'once',
    -- The latest slot some process enqueued, and the slot after it. Written only by the process
    -- whose insert won, so a herd of processes does not fight over this row every tick.
    last_slot   timestamptz,
    next_slot   timestamptz,
    -- When a process last started with this schedule declared; an old value with an old
    -- updated_at means nothing runs this schedule any more.
    declared_at timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT cron_schedules_key_not_empty CHECK (key <> ''),
    CONSTRAINT cron_schedules_catch_up_known CHECK (catch_up IN ('once', 'skip'))
);
