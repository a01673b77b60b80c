"""Optional integrations with other frameworks. Nothing in the core, the CLI, the monitor or the
developer tools imports them (see the import contract in pyproject.toml), so each needs its
framework only when it is used."""
