"""`ctxcache bench worker`: TTFT with cached history vs full recompute (`worker.py`) and the
outputs (`worker_report.py`)."""
