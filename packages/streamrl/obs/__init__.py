"""Observability: Perfetto traces (`tracing`), per-worker counters (`metrics`), the run's
report (`report`) and the live dashboard (`status`)."""
