"""The streaming session: streamer, leases, RAM controller, verification."""
