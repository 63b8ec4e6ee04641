"""The coordinator: bootstrap DHT node, run publisher, chain former, progress watcher (``python -m coordinator``)."""
