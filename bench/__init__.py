"""Benchmarks: commands that measure moestream against in-run references. Not shipped."""
