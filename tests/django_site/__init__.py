"""A minimal Django project for tests/test_django.py: its settings and its tasks."""
