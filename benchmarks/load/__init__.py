"""`ctxcache bench load`: concurrent sessions through the stack (`load.py`), its stack and
what it observes of it (`load_stack.py`), a session's requests (`load_driver.py`) and the
outputs (`load_report.py`)."""
