"""``rlflow`` subcommands, one module each (``COMMANDS`` in ``rlflow.schedulers.cli`` maps names to them)."""
