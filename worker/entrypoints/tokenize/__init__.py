"""`tokenize` endpoint: api_router (HTTP), protocol (bodies), serving (logic)."""
