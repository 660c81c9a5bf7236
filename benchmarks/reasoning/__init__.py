"""`ctxcache bench reasoning`: a thinking model's conversations with tool calls under each
rule for past reasoning (`reasoning.py`), the modes that send them (`reasoning_modes.py`),
the stack they run on (`reasoning_stack.py`) and the outputs (`reasoning_report.py`)."""
