"""The bottom layer: the exceptions aioshmq raises and its logger, used by every layer."""
