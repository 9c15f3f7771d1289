"""The planner: how many workers the fleet runs, from its load or its latency targets (Dynamo's)."""
