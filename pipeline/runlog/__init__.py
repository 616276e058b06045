"""The structured per-token run log: its writer and its reader."""
