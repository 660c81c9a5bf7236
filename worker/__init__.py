"""worker: the CPU inference worker (`ctxcache worker`); see docs/worker.md and SPEC.md."""
