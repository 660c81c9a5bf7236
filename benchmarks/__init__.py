"""Every benchmark of the repo (`ctxcache bench <name>`), kept out of the service packages.

Each module has `add_arguments(parser)` and `main(args) -> int`; `cli.py` lists them.
Outputs follow one shape (`util.py`): `NAME.json`, `NAME.md` and `NAME.png`.
"""
