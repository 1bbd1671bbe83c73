"""The aioshmq logger: attaches, departures, deaths, corruption, slow readers; never per message."""

from __future__ import annotations

import logging

log = logging.getLogger("aioshmq")
