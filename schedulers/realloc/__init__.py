"""Parameter reallocation: which slice of each parameter a rank holds, the transfer plan between two
layouts (pure), and its execution on a torch.distributed process group.
"""
