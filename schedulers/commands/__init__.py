"""`rlflow` subcommands of the schedulers layer (see COMMANDS in dataflow/cli.py)."""
