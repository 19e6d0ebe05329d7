"""Task generators (data sets made by code, with checkable answers); importing registers them."""

from rlflow.nodes.tasks import arith as arith
from rlflow.nodes.tasks import code_task as code_task
from rlflow.nodes.tasks import search as search

__all__ = ["arith", "code_task", "search"]
