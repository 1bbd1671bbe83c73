"""Turning objects into a main byte string plus out-of-band buffers, and back: pickle,
cloudpickle, msgspec and torch tensors."""
