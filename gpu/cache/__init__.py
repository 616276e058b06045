"""The device expert cache's bookkeeping: entries, pool, eviction policy, placement."""
