"""Task generators (data sets made by code, with checkable answers); importing registers them."""

from rlflow.nodes.tasks import arith as arith

__all__ = ["arith"]
