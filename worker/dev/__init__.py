"""Developer tools around the queue: the embedded PostgreSQL, the benchmark and the demo.

Nothing in the queue's core imports this package; the CLI hands these tools a DSN.
"""
