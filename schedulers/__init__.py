"""rlflow's schedulers layer: where and when nodes run (planner, reallocation, runtime, records, CLI).

See ``DESIGN.md`` ("Layers").
"""
