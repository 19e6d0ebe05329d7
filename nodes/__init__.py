"""rlflow: nodes layer (see DESIGN in README)."""
