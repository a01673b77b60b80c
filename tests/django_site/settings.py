"""Settings of the test Django project. The database and the queue's schema come from the
environment (DJANGO_SITE_DSN, DJANGO_SITE_SCHEMA), set by tests/test_django.py for its own
process and for the `manage.py worker_run` processes it starts."""

from __future__ import annotations

import importlib.util
import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DJANGO_SITE_DSN"])

SECRET_KEY = "test-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["worker.contrib.django", "django_site"]
if importlib.util.find_spec("django.tasks") is None:  # Django before 6.0: the backport
    INSTALLED_APPS.append("django_tasks")
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    },
    "other": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
# The same database under another name, which the tests never migrate (`manage.py migrate`
# makes the schema of each backend on the database it migrates): the "unmigrated" backend's.
DATABASES["elsewhere"] = dict(DATABASES["default"])
# The "sqlite" backend below exists to be refused (tests/test_django.py): its system check would
# stop every management command of this project.
SILENCED_SYSTEM_CHECKS = ["worker.E001"]
TASKS = {
    "default": {
        "BACKEND": "worker.contrib.django.WorkerBackend",
        "QUEUES": ["default", "mail"],
        "OPTIONS": {"SCHEMA": os.environ["DJANGO_SITE_SCHEMA"]},
    },
    # The composition matrix's tasks (tests/test_matrix.py, django_site/matrix_tasks.py).
    "matrix": {
        "BACKEND": "worker.contrib.django.WorkerBackend",
        "QUEUES": ["mx"],
        "OPTIONS": {"SCHEMA": os.environ["DJANGO_SITE_SCHEMA"], "MAX_ATTEMPTS": 10},
    },
    "retrying": {
        "BACKEND": "worker.contrib.django.WorkerBackend",
        "QUEUES": [],
        "OPTIONS": {"SCHEMA": os.environ["DJANGO_SITE_SCHEMA"], "MAX_ATTEMPTS": 3},
    },
    "unmigrated": {
        "BACKEND": "worker.contrib.django.WorkerBackend",
        "OPTIONS": {"SCHEMA": "no_such_schema", "DATABASE": "elsewhere"},
    },
    "sqlite": {
        "BACKEND": "worker.contrib.django.WorkerBackend",
        "OPTIONS": {"DATABASE": "other"},
    },
}
