"""Data: token sources and the sharded, resumable batch loader. Knows nothing about strategies."""

from meshforge.data.loader import ShardedBatchLoader
from meshforge.data.sources import DataError, batch_loader, build_source
from meshforge.data.workers import background

__all__ = ["DataError", "ShardedBatchLoader", "background", "batch_loader", "build_source"]
