"""The planner: cluster files, plan values, the cost model, the simulator, plan search and profile fitting.

Pure values and functions: nothing here starts a process or imports the runtime.
"""
