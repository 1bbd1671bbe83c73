"""The ring: its byte format (declared once, in ``format``), memory ordering, the two cores
that do the per-message work (compiled and pure, with the same primitives), and the rarer
ring logic written once over them.  Never waits and never touches an event loop."""
