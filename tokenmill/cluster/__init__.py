"""Serving over a fleet of engine workers: the KV-aware router, the KV-event index it routes by, and
the launchers that start workers. Torch-free: the front and router never load a model."""
