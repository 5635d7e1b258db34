"""What the broker says about itself: structured logs, Prometheus metrics, trace ids, and
optional OpenTelemetry."""
