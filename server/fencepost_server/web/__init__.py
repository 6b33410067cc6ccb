"""The HTTP side port: the dashboard, its JSON API and /metrics."""
