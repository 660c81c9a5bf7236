"""`GET /v1/models`, `/health`, `/metrics`."""
