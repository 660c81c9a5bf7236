"""Code every benchmark shares: outputs and timing (`util.py`), the processes a stack is
made of and the one stack builder (`process.py`, `stack.py`), and the servers benchmarks
and tests start beside ctxcache (`fake_worker.py`, `bare_relay.py`, `otlp_sink.py`)."""
