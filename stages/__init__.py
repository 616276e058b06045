"""moestream stages: prefetch (reads), staging (pinned ring), upload (H2D streams), install."""
