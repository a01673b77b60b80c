-- 0009: what the operator console writes: queues an operator paused, and a record of every
-- action taken from the console.
--
-- Neither table is on the path of a task: the task table gains no column and no index here (the
-- console reads it through the indexes of 0001-0007).
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- A queue listed here is paused: workers claim nothing from it until it is resumed (the row is
-- deleted). Tasks already running finish. Rows survive worker restarts; every worker reads the
-- same table, so a pause is fleet-wide.
CREATE TABLE {schema}.paused_queues (
    queue     text        PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text        NOT NULL DEFAULT '',
    CONSTRAINT paused_queues_queue_length CHECK (queue <> '' AND char_length(queue) <= 255),
    CONSTRAINT paused_queues_by_length CHECK (char_length(paused_by) <= 200)
);

-- One row per action taken from the console: who (the name the operator gave at sign-in), from
-- which address, what, on which task, queue or filter, and how many rows it changed. Never the
-- console token.
CREATE TABLE {schema}.console_audit (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,
    address  text        NOT NULL,
    action   text        NOT NULL,
    target   jsonb       NOT NULL DEFAULT '{}',
    affected bigint      NOT NULL DEFAULT 0
);

CREATE INDEX console_audit_at_idx ON {schema}.console_audit (at);
