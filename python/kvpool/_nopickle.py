"""``NotPicklable``: objects that own one process's pool state refuse ``pickle`` with a
``TypeError`` that names them and says what to send instead. Without it, pickling
one fails deep inside on "cannot pickle '_thread.RLock' object", which names neither
the object nor the fix (multiprocessing pickles whatever crosses a process boundary).
``NotCopyable`` (which every ``NotPicklable`` is): objects whose copy would share that state
refuse ``copy.copy`` and ``copy.deepcopy`` with a ``CopyRefusedError`` (a ``TypeError``) that
names them and says what to do instead, where the copy modules' fallback to pickling refused
with the pickling message."""

from __future__ import annotations

from typing import Any, ClassVar

SEND_INSTEAD = ("send plain results (handles, page tables, stats(), take_events()) to another process, "
                "or build the object there")


class NotCopyable:
    """``copy.copy`` and ``copy.deepcopy`` refused with ``CopyRefusedError`` (a ``TypeError``) that
    names the object and says what to do instead. Without it ``copy.copy`` made a second object
    sharing the first one's state (its pools, graphs, static buffers), and ``copy.deepcopy`` failed
    on whatever inside it refuses pickling, naming that instead."""

    #: Why a copy is refused and what to do instead (completes "cannot copy a X: ...").
    _copy_refusal: ClassVar[str] = ("a copy would share (or duplicate) the pool state it holds: pass this object "
                                    "itself where it is needed, or build another")

    def __copy__(self) -> Any:
        from kvpool.errors import CopyRefusedError

        raise CopyRefusedError(f"cannot copy a {type(self).__name__}: {self._copy_refusal}")

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__copy__()

    def __replace__(self, **changes: Any) -> Any:
        # Python 3.13's copy.replace() builds a modified copy: refused for the same reason, with the
        # same typed error (without it, copy.replace says only that it "does not support" the type).
        return self.__copy__()


class NotPicklable(NotCopyable):
    #: Why this class cannot cross a process boundary (completes "cannot pickle a X: ...").
    _pickle_refusal: ClassVar[str] = "it holds this process's pool state"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle a {type(self).__name__}: {self._pickle_refusal}; {SEND_INSTEAD}")
