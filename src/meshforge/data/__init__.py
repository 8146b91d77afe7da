"""Data: token sources and the sharded, resumable batch loader. Knows nothing about strategies."""

from meshforge.data.loader import ShardedBatchLoader
from meshforge.data.sources import DataError, build_source

__all__ = ["DataError", "ShardedBatchLoader", "build_source"]
