"""The store: every statement that changes a task row, and nothing else.

A task row changes in one place: the functions of this room (and the SQL functions they call).
Claims, acknowledgements, rescue and retention, enqueue, operator retries, cancels and deletes
all go through here, each fenced where it must be. ``tests/test_store.py`` fails when a statement
that writes the task table runs from anywhere else."""
