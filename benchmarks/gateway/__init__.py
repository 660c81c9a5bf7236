"""`ctxcache bench gateway` and `bench gateway-ab`: the gateway's overhead (`gateway.py`,
`gateway_ab.py`), its stack and CPU placement (`gateway_stack.py`), a case's measurement
(`gateway_measure.py`, `loadgen.py`, `wrk.py`) and the outputs (`gateway_report.py`)."""
