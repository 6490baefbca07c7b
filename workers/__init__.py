"""The Celery app and its settings, chunk execution against replicas, spot preemption handling,
and the worker entry point per lane."""
