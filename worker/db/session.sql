-- Session settings and small reads every duty's connection may run.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: no_jit
-- For the rest of the transaction: the views here run in milliseconds, and their cost estimates
-- (counts that stop at a cap) are high enough that JIT would compile them first, which alone takes
-- longer (130 ms and more on a 2-core machine).
SELECT set_config('jit', 'off', true);

-- name: db_now
SELECT now() AS now;

-- name: session_statement_timeout
-- The statement timeout of the rest of the session (vacuum lifts it for its own statement).
SELECT set_config('statement_timeout', %(ms)s, false);

-- name: session_settings
-- A duty's session settings (worker.db.connect), in one round trip when a connection is made:
-- its statement, lock and idle-in-transaction timeouts ('0': the server's default) and, for the
-- worker's own connections (claim loop, lease keeper, maintenance), plans kept on the indexes. Every statement
-- those connections run is meant to reach its rows through an index. Their statements are
-- prepared, and PostgreSQL soon caches a generic plan, costed with the table's statistics of that
-- moment: a worker that starts on an empty or freshly truncated table would keep a sequential scan
-- for good, and the claim would then read the whole table, done rows and dead versions included,
-- each time (measured at 2,000 buffers per claim once the table held 9,000 finished rows, and
-- growing with it). Ruling sequential scans out keeps every plan, cached or not, on the indexes,
-- whatever the table held when it was made. Behind PgBouncer (no session settings) nothing is
-- prepared, so each statement is planned afresh against the table's actual size.
SELECT set_config('statement_timeout', %(statement_ms)s, false),
       set_config('lock_timeout', %(lock_ms)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_ms)s, false),
       set_config('enable_seqscan', %(seqscan)s, false);
