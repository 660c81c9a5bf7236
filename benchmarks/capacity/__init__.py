"""`ctxcache bench capacity`: req/s held at a p95 TTFT target (`capacity.py`), the open-loop
load (`capacity_load.py`) and the outputs (`capacity_report.py`)."""
