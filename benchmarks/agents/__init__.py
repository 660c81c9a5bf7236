"""`ctxcache bench agents`: an agent's tool loop (`agents.py`), its ways of sending a turn
(`agents_ways.py`) and the outputs (`agents_report.py`)."""
