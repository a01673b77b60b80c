"""Coordination between workers and operators: cron schedules, lock rows, advisory locks,
paused queues and cancel requests. Each lives in a table of its own, so it holds fleet-wide."""
