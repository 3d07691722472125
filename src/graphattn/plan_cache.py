"""The plan caches of the functional API and of dynamic graph partitions: entries by call signature, least
recently used evicted, and entries replayed for new lengths in a smaller tier of their own; and changed_copy,
with which a replay derives an entry for new lengths from a cached one."""
from __future__ import annotations

from collections import OrderedDict

CACHE_SIZE = 256
# Entries re-made for new lengths: enough for the lengths of a few steps' calls (a model's layers repeat each
# step's), so that a loop of new lengths evicts only its own older ones, never an entry made in full.
REPLAYED_CACHE_SIZE = 16


def changed_copy(record, **changes):
    """A copy of an object (a dataclass record, a kernel) with these attributes changed: dataclasses.replace
    without its walk over every field, nor copy.copy's generic protocol, which cost a new length's replay more
    than the rest of it."""
    copied = object.__new__(type(record))
    copied.__dict__.update(record.__dict__)
    copied.__dict__.update(changes)
    return copied


class SignatureCache:
    """Entries by call signature (layouts, dtypes, flags): the last CACHE_SIZE used are kept, and apart from
    them the last REPLAYED_CACHE_SIZE put as replayed (re-made for new lengths), oldest out first."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()
        self._replayed: OrderedDict = OrderedDict()

    def get(self, signature):
        """The entry, or None.  A hit counts as a use once the cache is half full: before that nothing can be
        evicted for CACHE_SIZE / 2 more new signatures, and the reordering is a visible share of a tiny call."""
        entry = self._entries.get(signature)
        if entry is None:
            return self._replayed.get(signature)
        if len(self._entries) > CACHE_SIZE // 2:
            try:
                self._entries.move_to_end(signature)
            except KeyError:  # another thread evicted it since the lookup: the entry itself is still good
                pass
        return entry

    def __len__(self) -> int:
        """The entries made in full (the replayed ones are not counted)."""
        return len(self._entries)

    def replayed_count(self) -> int:
        return len(self._replayed)

    def clear(self) -> None:
        self._entries.clear()
        self._replayed.clear()

    def put(self, signature, entry, replayed: bool = False) -> None:
        entries, size = (self._replayed, REPLAYED_CACHE_SIZE) if replayed else (self._entries, CACHE_SIZE)
        entries[signature] = entry
        while len(entries) > size:
            try:
                entries.popitem(last=False)
            except KeyError:  # another thread emptied it meanwhile
                break
