"""The monitor: metric instruments and hooks, the journal, the read model, the HTTP server and
the status page. It imports the queue's core; the core never imports it (observers attach through
``worker.hooks``)."""
