"""What users call to open an end: ``create``, ``connect`` and ``aconnect``, for local rings
and remote ones alike."""
