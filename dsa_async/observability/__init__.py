"""Observability: Prometheus metrics, their exposition and event-loop lag."""
