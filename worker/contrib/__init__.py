"""Optional integrations, one module each, installed as extras (``pip install 'worker-pg[otel]'``).

The core never imports this package (an import-linter contract in pyproject.toml says so): an
integration registers itself into the core's extension points (``worker.hooks``) when the
application asks for it, and nothing here is imported otherwise.
"""
