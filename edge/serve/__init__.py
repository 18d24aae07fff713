"""The HTTP service: the app, OpenAI and KServe routes, limits, connections, workers, metrics, and edge's own HTTP client."""
