# The compiled twin of _cancel's common case.
from collections.abc import Awaitable, Callable
from typing import Any

def pending_checkpoint() -> Callable[[], Awaitable[None]] | None: ...
def setup(
    seen: list[tuple[int, Any, bool]],
    current_tasks: dict[Any, Any],
    cache: dict[int, tuple[Any, Any]],
    fast: list[bool],
    checkpoint: Callable[[], Awaitable[None]],
    slow: Callable[[], Callable[[], Awaitable[None]] | None],
    state_type: type | None = None,
    scope_type: type | None = None,
    /,
) -> None: ...
def direct_fields() -> list[str]: ...
def in_event_loop() -> bool: ...
def setup_loop_check(
    get_running_loop: Callable[[], object],
    modules: dict[str, Any],
    slow: Callable[[], bool],
    /,
) -> None: ...
def setup_sync(
    end: type,
    writer: type,
    reader: type,
    lock: type,
    serializer: type,
    put_sync: Callable[..., None],
    get_sync: Callable[..., Any],
    empty: object,
    /,
) -> tuple[Any, Any]: ...
def setup_async(
    end: type,
    put: Callable[..., Any],
    get: Callable[..., Any],
    /,
) -> tuple[Any, Any]: ...
