"""Subcommands of the ``rlflow`` CLI (see ``dataflow.cli.COMMANDS``)."""
