-- 0004: refuse rows that can never run, at the insert, instead of failing at the claim.
--
-- A producer with INSERT alone could write a task no worker can ever handle: a run_at of
-- '-infinity' (the driver cannot represent it, so the claim failed while decoding its rows and
-- rolled back, and every good task of the queue waited behind it), or a megabyte task name that
-- then travels into every log line, page and metric that names it. These constraints turn such
-- inserts into errors the producer sees. They are NOT VALID: rows already in the table are not
-- checked (a migration must not fail on old data); the worker copes with those too (the claim
-- returns payloads as text, decoded per task by the worker, and non-finite times as the nearest
-- finite ones).
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.tasks
    ADD CONSTRAINT tasks_run_at_finite CHECK (isfinite(run_at)) NOT VALID,
    ADD CONSTRAINT tasks_created_at_finite CHECK (isfinite(created_at)) NOT VALID,
    ADD CONSTRAINT tasks_task_length CHECK (char_length(task) <= 255) NOT VALID,
    ADD CONSTRAINT tasks_queue_length CHECK (char_length(queue) <= 255) NOT VALID,
    ADD CONSTRAINT tasks_dedupe_key_length CHECK (char_length(dedupe_key) <= 1000) NOT VALID;
