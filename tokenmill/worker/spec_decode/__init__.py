"""Speculative decoding in the worker: proposers guess a request's next tokens, the target model
verifies them in one pass (the sampler's rejection step), and a controller sizes the guesses."""
