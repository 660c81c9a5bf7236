"""The dashboard's parts: PromQL helpers (promql), panel shapes (panel), and the
panels of each component, one module per row or pair of rows (gateway, sidecar, engine,
connector, store, processes). deploy/monitoring/dashboard.py puts them in order."""
