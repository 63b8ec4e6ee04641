"""Run a coroutine to completion from synchronous code that may itself be inside an event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


def run_in_fresh_loop(coro: Coroutine[Any, Any, Any], name: str) -> Any:
    """Run ``coro`` on a fresh event loop in a helper thread named ``name`` and return its result;
    its exception (any, cancellation included) is raised in the caller's thread."""
    result: dict = {}

    def target() -> None:
        try:
            result["ok"] = asyncio.run(coro)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=name)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["ok"]
