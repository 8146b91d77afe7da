"""Distributed training: MeshContext, one module per strategy and per parallelism, and the order they apply in.

`setup` and `parallelize` are imported eagerly: the submodule `parallelize.py` would otherwise replace the
function of the same name on this package the first time it is imported.
"""

from meshforge.distributed.parallelize import parallelize, setup

__all__ = ["parallelize", "setup"]
