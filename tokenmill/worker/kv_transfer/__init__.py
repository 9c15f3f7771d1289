"""Moving KV blocks between workers (disaggregated prefill and decode)."""
