"""worker: see SPEC.md."""
