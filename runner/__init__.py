"""Model side of kvcache: model, attention, loader, and (by others) scheduler/engine."""
