"""Readers on other hosts: the writer's server, remote readers and mirrors, over ZeroMQ."""

from ._mirror import Mirror, mirror

__all__ = ["Mirror", "mirror"]
