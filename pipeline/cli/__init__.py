"""The command lines: shared plumbing, ``moestream.pipeline.cli.run``'s two engines, progress."""
