"""The foundation every layer stands on: errors, config, the GGUF table, digests,
fault plans, atomic files. It imports nothing of moestream above it."""
