"""The task API: handlers and their registry, typed payloads, enqueue, results, waiting, and
the declarations of flow-control limits."""
