-- Vacuum of the task table between autovacuum's rounds.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: vacuum_state
-- Dead row versions in the task table, seconds since it was last vacuumed (by anyone), whether
-- this role may vacuum it (only the owner, or a member of the owning role, may), and whether a
-- vacuum of it runs now (autovacuum's, seen where this role may read its progress).
SELECT s.n_dead_tup::bigint AS dead,
       extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8 AS since,
       pg_has_role(c.relowner, 'MEMBER') AS allowed,
       EXISTS (SELECT 1 FROM pg_stat_progress_vacuum AS v WHERE v.relid = s.relid) AS running
  FROM pg_stat_user_tables AS s
  JOIN pg_class AS c ON c.oid = s.relid
 WHERE s.relid = to_regclass(%(table)s);

-- name: vacuum_horizon
-- The oldest transaction id that keeps vacuum from removing rows (a session's snapshot or
-- transaction, a prepared transaction, a replication slot), as text; NULL when none is seen.
-- While it stays the same, a vacuum that removed little last time would remove little again.
-- Sessions of other databases do not hold back the vacuum of this database's tables.
SELECT x::text AS oldest
  FROM (SELECT backend_xmin AS x FROM pg_stat_activity
         WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
           AND datname = current_database()
        UNION ALL
        SELECT backend_xid FROM pg_stat_activity
         WHERE backend_xid IS NOT NULL AND datname = current_database()
        UNION ALL
        SELECT transaction FROM pg_prepared_xacts WHERE database = current_database()
        UNION ALL
        SELECT xmin FROM pg_replication_slots WHERE xmin IS NOT NULL
        UNION ALL
        SELECT catalog_xmin FROM pg_replication_slots WHERE catalog_xmin IS NOT NULL) AS h
 ORDER BY age(x) DESC
 LIMIT 1;

-- name: vacuum_try_lock
-- One vacuuming process per schema across the fleet; the others skip this round.
SELECT pg_try_advisory_lock(%(class)s, %(key)s) AS got;

-- name: vacuum_unlock
SELECT pg_advisory_unlock(%(class)s, %(key)s);

-- name: vacuum_tasks
-- SKIP_LOCKED: if autovacuum (or anyone) is vacuuming it now, there is nothing to add.
VACUUM (SKIP_LOCKED) {schema}.tasks;

-- name: vacuum_permits
-- The permits of concurrency limits (schema/0020): a small table every limited claim updates,
-- whose dead versions a claim would otherwise walk until autovacuum's next visit.
VACUUM (SKIP_LOCKED) {schema}.limit_permits;
