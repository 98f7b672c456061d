"""The streaming engine: prompt building, the batched frame step, the streaming codec and the engine thread."""
