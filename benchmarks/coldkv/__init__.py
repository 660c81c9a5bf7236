"""`ctxcache bench cold-kv`: the sidecar's fp8 cold tiers against plain ones on the same
conversations (`coldkv.py`), the measurements (`coldkv_run.py`) and the outputs
(`coldkv_report.py`)."""
