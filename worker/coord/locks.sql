-- Lock rows with an expiry (schema/0002) and advisory locks.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: lock_acquire
-- Take the lock if it is free (no row, or its row expired) or, when re-entrant, already ours.
-- ON CONFLICT ... DO UPDATE ... WHERE makes the check and the write one atomic step: concurrent
-- contenders queue on the row and each re-checks the WHERE against the winner's committed row, so
-- exactly one gets a row back. A NULL ttl means "never expires" (a mutex).
INSERT INTO {schema}.locks AS l (name, holder, kind, acquired_at, renewed_at, expires_at)
VALUES (%(name)s, %(holder)s, %(kind)s, now(), now(),
        CASE WHEN %(ttl)s::float8 IS NULL THEN 'infinity'::timestamptz
             ELSE now() + make_interval(secs => %(ttl)s::float8) END)
ON CONFLICT (name) DO UPDATE
   SET holder = excluded.holder,
       kind = excluded.kind,
       -- A re-entrant acquire by the holder keeps the original acquisition time.
       acquired_at = CASE WHEN l.holder = excluded.holder AND l.expires_at > now()
                          THEN l.acquired_at ELSE now() END,
       renewed_at = now(),
       expires_at = excluded.expires_at
 WHERE l.expires_at <= now()
    OR (%(reentrant)s::boolean AND l.holder = excluded.holder)
-- NULL stands for 'infinity', which Python's datetime cannot hold.
RETURNING CASE WHEN isfinite(l.expires_at) THEN l.expires_at END AS expires_at;

-- name: lock_extend
-- Push the expiry out, for the holder only. It succeeds even after the expiry passed as long as no
-- one else took the lock meanwhile (then nothing ran concurrently). No row back: the lock is lost.
UPDATE {schema}.locks
   SET expires_at = CASE WHEN %(ttl)s::float8 IS NULL THEN 'infinity'::timestamptz
                         ELSE now() + make_interval(secs => %(ttl)s::float8) END,
       renewed_at = now()
 WHERE name = %(name)s
   AND holder = %(holder)s
RETURNING CASE WHEN isfinite(expires_at) THEN expires_at END AS expires_at;

-- name: lock_release
-- Only the holder may release. See docs/cron-and-locks.md before releasing an exclusive job's
-- lock: a contender that arrives late for the same trigger would run the job a second time.
DELETE FROM {schema}.locks
 WHERE name = %(name)s
   AND holder = %(holder)s
RETURNING name;

-- name: lock_force_release
-- Operator's escape hatch (`worker locks --release NAME`), e.g. for a mutex whose holder died.
DELETE FROM {schema}.locks
 WHERE name = %(name)s
RETURNING name, holder, kind;

-- name: lock_list
-- Every lock row with its state by the database clock. Rows of free locks stay until the name is
-- taken again (one small row per name); expires_in_seconds is NULL for a mutex.
SELECT name, kind, holder, acquired_at, renewed_at,
       CASE WHEN isfinite(expires_at) THEN expires_at END AS expires_at,
       expires_at > now() AS held,
       CASE WHEN isfinite(expires_at)
            THEN extract(epoch FROM expires_at - now())::float8 END AS expires_in_seconds
  FROM {schema}.locks
 ORDER BY name;

-- name: lock_purge_expired
-- Forget lock rows that expired long ago (a free lock's row and a missing row mean the same), for
-- applications that lock many short-lived names such as one per record.
DELETE FROM {schema}.locks
 WHERE expires_at < now() - make_interval(secs => %(older_than_seconds)s::float8)
RETURNING name;

-- name: advisory_try_xact
-- Transaction-scoped: released by COMMIT or ROLLBACK, and by the server when the client dies.
SELECT pg_try_advisory_xact_lock(%(key1)s::integer, %(key2)s::integer) AS won;

-- name: advisory_try_session
-- Session-scoped: held until unlocked or until the connection closes; see the PgBouncer caveat.
SELECT pg_try_advisory_lock(%(key1)s::integer, %(key2)s::integer) AS won;

-- name: advisory_unlock_session
SELECT pg_advisory_unlock(%(key1)s::integer, %(key2)s::integer) AS released;

-- name: advisory_list
-- Advisory locks in this database with the session that holds (or waits for) each. The two-key
-- form (objsubid = 2) is shown as two signed int4s, as the lock functions take them; the one-key
-- form (objsubid = 1) as its bigint. Reading pg_locks takes the lock manager's partition locks:
-- fine for an operator's command, not for a hot path.
SELECT l.pid,
       l.objsubid = 2 AS two_keys,
       CASE WHEN l.objsubid = 2 THEN
           (l.classid::bigint - CASE WHEN l.classid::bigint >= 2147483648 THEN 4294967296 ELSE 0 END)
       END AS key1,
       CASE WHEN l.objsubid = 2 THEN
           (l.objid::bigint - CASE WHEN l.objid::bigint >= 2147483648 THEN 4294967296 ELSE 0 END)
       END AS key2,
       CASE WHEN l.objsubid = 1 THEN (l.classid::bigint << 32) | l.objid::bigint END AS key,
       l.mode,
       l.granted,
       a.state,
       a.application_name,
       a.client_addr::text AS client_addr,
       a.xact_start,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_seconds,
       a.query
  FROM pg_locks AS l
  LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY l.granted DESC, l.pid, key1, key2;
