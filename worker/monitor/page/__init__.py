"""The read-only status page: its sections, markup helpers and the database-health panel."""
