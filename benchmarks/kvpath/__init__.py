"""`ctxcache bench kvpath` (also `python -m benchmarks.kvpath`, without the CLI: a GPU box
without vLLM): KV load/store through the connector (`kvpath.py`, `kvpath_cuda.py`,
`kvpath_report.py`) and through a real vLLM (`kvpath_vllm.py`, `kvpath_vllm_report.py`)."""
