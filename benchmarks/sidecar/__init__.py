"""`ctxcache bench sidecar`: KV block bandwidth (`sidecar.py`) against the targets it starts
(`sidecar_targets.py`), the local path's leases (`sidecar_leases.py`) and the outputs
(`sidecar_report.py`)."""
