-- 0021: a state for workflow steps that wait for their dependencies.
--
-- A step of a workflow (0021) whose dependencies have not all finished is a row in 'waiting': no
-- claim, promotion or rescue looks at it, and the acknowledgement that finishes its last
-- dependency makes it 'queued' (or 'scheduled', when its run_at is still ahead). This file only
-- adds the value: PostgreSQL cannot use a new enum value in the transaction that adds it, so the
-- migrator commits each file on its own, and 0022 uses it.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TYPE {schema}.task_state ADD VALUE IF NOT EXISTS 'waiting' BEFORE 'scheduled';
