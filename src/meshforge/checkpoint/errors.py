class CheckpointError(Exception):
    """A checkpoint that cannot be used (missing, truncated, from another model); one line, exit code 2."""
