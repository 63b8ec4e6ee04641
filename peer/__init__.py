"""The voloco peer process: model, data, inner and outer training, exchange, pipeline stage, state, CLI."""
