"""Data access: the named SQL statements, the connection factory, DSN handling and redaction,
and migrations. Everything above talks to PostgreSQL through this room; it imports no other."""
