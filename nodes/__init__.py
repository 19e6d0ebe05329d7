"""rlflow's nodes layer: what a node computes (models, generation, rewards, the RL maths, train steps).

See ``DESIGN.md`` ("Layers") and ``nodes/README.md``.
"""
