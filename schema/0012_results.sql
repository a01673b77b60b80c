-- 0012: a handler's return value, stored with its row (see worker/_results.py).
--
-- Only tasks whose handler stores results (`@worker.task(..., store_result=True)`, or a worker
-- run with --store-results) ever write this column, and only in the statement that marks them
-- done (complete_with_result in queries/results.sql). Every other task leaves it NULL: its
-- acknowledgement is the `complete` statement as before. A nullable column without a default
-- is a change to the catalog only: no rewrite of the table, however many rows it holds.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.tasks ADD COLUMN result jsonb;

COMMENT ON COLUMN {schema}.tasks.result IS
    'the handler''s return value, for tasks that store results (NULL otherwise)';
