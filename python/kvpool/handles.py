"""Request handles: ``(generation << 32) | row``.

The row (low 32 bits) indexes ``req_to_token``; the generation makes a handle
used after ``close`` fail loudly instead of aliasing the row's next request.
"""

from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError

#: ``handle & ROW_MASK`` is a handle's row (vectorizes over numpy arrays).
ROW_MASK = 0xFFFFFFFF


def handle_row(handle: Any) -> int:
    """Row of ``handle`` in a request-to-token table (its low 32 bits)."""
    # Checked because int() would truncate a float or parse a string into some
    # other request's row.
    if isinstance(handle, (bool, np.bool_)) or not isinstance(handle, (int, np.integer)) \
            or not 0 <= handle < 1 << 64:
        raise InvalidArgumentError(
            f"handle must be a request handle, an int in [0, 2**64) as open() returns, "
            f"got {type(handle).__name__} {handle!r}")
    return int(handle) & ROW_MASK
