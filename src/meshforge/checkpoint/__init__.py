"""Checkpoints: DCP save/load in each format, atomic commit with LATEST, exact resume."""
