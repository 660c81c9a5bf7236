"""Every benchmark of the repo (`ctxcache bench <name>`), kept out of the service packages.

Each benchmark's module has `add_arguments(parser)` and `main(args) -> int`; `cli.py` lists
them. A benchmark of several files has a folder of its own (`gateway/`, `kvpath/`, ...);
what they share is in `lib/`: outputs of one shape (`lib/util.py`: `NAME.json`, `NAME.md`
and `NAME.png`) and the one stack builder (`lib/stack.py`).
"""
