"""`chat_completions` endpoint: api_router (HTTP), protocol (bodies), serving (logic)."""
