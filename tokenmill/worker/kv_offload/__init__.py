"""KV-cache offload tiers: host memory, local disk and a shared directory."""
