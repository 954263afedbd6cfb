"""Progress bars for the demo and the benchmarks: tqdm when it is installed, else none.

tqdm is an optional dependency (``pip install kvpool[demo]`` or ``[bench]``);
the pool itself never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["progress"]


class _NoBar:
    """The part of tqdm's interface kvpool uses, doing nothing."""

    def __init__(self, iterable: Iterable[Any] | None = None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Any:
        return iter(self._iterable if self._iterable is not None else ())

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        return None

    def close(self) -> None:
        return None


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)``, or an object with the same methods that shows nothing."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, **kwargs)
