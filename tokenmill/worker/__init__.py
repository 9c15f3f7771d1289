"""Workers: a device, its part of the model and of the KV cache; they run the steps the engine plans."""
