"""Operating-system resources shared between processes: the ring's memfd mapping and the
wake-up fds (eventfd or pipe).  Knows nothing of what the memory holds."""
