"""warmup."""
