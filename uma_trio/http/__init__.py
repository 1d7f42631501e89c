"""HTTP front ends on hypercorn's trio worker: the OpenAI-compatible gateway (``--http``)
and the Prometheus-only ``--metrics-port``."""
