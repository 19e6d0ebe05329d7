"""rlflow: schedulers layer (see DESIGN in README)."""
