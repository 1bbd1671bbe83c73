"""The ends users hold: ``Writer`` and ``Reader`` (anyio object streams over a ring), their
attach broker, waiting, cancellation and the policies for slow readers."""
