"""Request handles: ``(generation << 32) | row``.

The row (low 32 bits) indexes ``req_to_token``; the generation makes a handle
used after ``close`` fail loudly instead of aliasing the row's next request.
"""

#: ``handle & ROW_MASK`` is a handle's row (vectorizes over numpy arrays).
ROW_MASK = 0xFFFFFFFF


def handle_row(handle: int) -> int:
    """Row of ``handle`` in a request-to-token table (its low 32 bits)."""
    return int(handle) & ROW_MASK
