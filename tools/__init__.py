"""Command-line tools: model maker, warm-up, log analysis, benchmarks."""
