"""`ctxcache bench sessions`: live sessions on one node (`sessions.py`), its stack and bulk
creation (`sessions_stack.py`), the sidecar's pin policies (`sessions_kv.py`) and the
outputs (`sessions_report.py`)."""
