"""`ctxcache bench multiturn`: multi-turn replay (`multiturn.py`, `multiturn_replay.py`), the
servers it replays against (`multiturn_stacks.py`), the in-process floor (`floor.py`) and
the outputs (`multiturn_report.py`)."""
