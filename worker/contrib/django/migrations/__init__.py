"""The queue's schema as Django migrations: one per worker migration (``schema/NNNN_name.sql``),
under the same name, each bringing the schema of the project's backends to that version (see
``worker.contrib.django.schema``)."""
