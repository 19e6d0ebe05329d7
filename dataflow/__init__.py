"""rlflow: dataflow layer (see DESIGN in README)."""
