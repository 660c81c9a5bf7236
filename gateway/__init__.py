"""gateway: see SPEC.md."""
