"""The plan caches of the functional API and of dynamic graph partitions: entries by call signature, least
recently used evicted; and changed_copy, with which a replay derives an entry for new lengths from a cached one."""
from __future__ import annotations

from collections import OrderedDict

CACHE_SIZE = 256


def changed_copy(record, **changes):
    """A copy of an object (a dataclass record, a kernel) with these attributes changed: dataclasses.replace
    without its walk over every field, nor copy.copy's generic protocol, which cost a new length's replay more
    than the rest of it."""
    copied = object.__new__(type(record))
    copied.__dict__.update(record.__dict__)
    copied.__dict__.update(changes)
    return copied


class SignatureCache:
    """Entries by call signature (layouts, dtypes, flags): the last CACHE_SIZE used are kept."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()

    def get(self, signature):
        """The entry, or None.  A hit counts as a use once the cache is half full: before that nothing can be
        evicted for CACHE_SIZE / 2 more new signatures, and the reordering is a visible share of a tiny call."""
        entry = self._entries.get(signature)
        if entry is not None and len(self._entries) > CACHE_SIZE // 2:
            try:
                self._entries.move_to_end(signature)
            except KeyError:  # another thread evicted it since the lookup: the entry itself is still good
                pass
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, signature, entry) -> None:
        self._entries[signature] = entry
        while len(self._entries) > CACHE_SIZE:
            try:
                self._entries.popitem(last=False)
            except KeyError:  # another thread emptied it meanwhile
                break
