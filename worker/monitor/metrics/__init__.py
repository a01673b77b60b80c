"""Prometheus metrics: the instruments, the hooks that count a worker's work, the journal
that keeps counts exact across a SIGKILL, and the collector behind /metrics."""
