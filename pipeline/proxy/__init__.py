"""The proxy engine: a decode loop over routing traces, computing on the experts."""
