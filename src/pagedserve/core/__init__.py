"""Scheduling core: the block pool, per-request block tables and the scheduler."""
