"""The coordinator: bootstrap DHT node, run publisher, progress watcher, and the demo."""
