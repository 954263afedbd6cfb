"""``NotPicklable``: objects that own one process's pool state refuse ``pickle`` with a
``TypeError`` that names them and says what to send instead. Without it, pickling
one fails deep inside on "cannot pickle '_thread.RLock' object", which names neither
the object nor the fix (multiprocessing pickles whatever crosses a process boundary)."""

from __future__ import annotations

from typing import Any, ClassVar

SEND_INSTEAD = ("send plain results (handles, page tables, stats(), take_events()) to another process, "
                "or build the object there")


class NotPicklable:
    #: Why this class cannot cross a process boundary (completes "cannot pickle a X: ...").
    _pickle_refusal: ClassVar[str] = "it holds this process's pool state"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle a {type(self).__name__}: {self._pickle_refusal}; {SEND_INSTEAD}")
