-- 0005: a state for rows that are not due yet.
--
-- Until now a delayed task was 'queued' with a future run_at, so it sat in the claim index and
-- every claim that found fewer due rows than it wanted walked all of the queue's delayed entries
-- (500k delayed rows made each light-load claim tens of milliseconds). Delayed rows now wait as
-- 'scheduled', in an index of their own, and any worker promotes them to 'queued' once due
-- (0006). This file only adds the value: PostgreSQL cannot use a new enum value in the
-- transaction that adds it, so the migrator commits each file on its own.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TYPE {schema}.task_state ADD VALUE IF NOT EXISTS 'scheduled' BEFORE 'queued';
