"""sidecar: see SPEC.md."""
