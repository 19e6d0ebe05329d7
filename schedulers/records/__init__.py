"""Run records: the run directory (metrics, traces, checkpoints, status), live Prometheus metrics and
the dashboards drawn from them.
"""
