"""moestream device side: backends (CuPy, host), expert cache, buffer pool, kernels."""
