"""The plan caches of the functional API and of dynamic graph partitions: entries by call signature, least
recently used evicted, and entries replayed for new lengths (the functional backward's) in a smaller tier of
their own."""
from __future__ import annotations

from collections import OrderedDict, deque

CACHE_SIZE = 256
# Entries re-made for new lengths: enough for the lengths of a few steps' calls (a model's layers repeat each
# step's), so that a loop of new lengths evicts only its own older ones, never an entry made in full.
REPLAYED_CACHE_SIZE = 16


class SignatureCache:
    """Entries by call signature (layouts, dtypes, flags): the last CACHE_SIZE used are kept, and apart from
    them the last REPLAYED_CACHE_SIZE put as replayed (re-made for new lengths), oldest out first.  One dict
    answers get for both tiers: a signature is hashed once per lookup, hit or miss (tuples do not keep their
    hash, and a signature's is a visible share of a tiny call)."""

    def __init__(self):
        self._all: dict = {}  # signature -> (entry, made in full)
        self._entries: OrderedDict = OrderedDict()  # signature -> entry made in full, least recently used first
        self._replayed: deque = deque()  # the replayed entries' signatures, oldest first

    def get(self, signature):
        """The entry, or None.  A hit on an entry made in full counts as a use once the cache is half full:
        before that nothing can be evicted for CACHE_SIZE / 2 more new signatures, and the reordering is a
        visible share of a tiny call."""
        found = self._all.get(signature)
        if found is None:
            return None
        if found[1] and len(self._entries) > CACHE_SIZE // 2:
            try:
                self._entries.move_to_end(signature)
            except KeyError:  # another thread evicted it since the lookup: the entry itself is still good
                pass
        return found[0]

    def __len__(self) -> int:
        """The entries made in full (the replayed ones are not counted)."""
        return len(self._entries)

    def replayed_count(self) -> int:
        return len(self._all) - len(self._entries)

    def clear(self) -> None:
        self._all.clear()
        self._entries.clear()
        self._replayed.clear()

    def put(self, signature, entry, replayed: bool = False) -> None:
        self._all[signature] = (entry, not replayed)
        if replayed:
            order = self._replayed
            order.append(signature)
            while len(order) > REPLAYED_CACHE_SIZE:
                try:
                    oldest = order.popleft()
                except IndexError:  # another thread emptied it meanwhile
                    break
                gone = self._all.pop(oldest, None)
                if gone is not None and gone[1]:  # made in full since (threads racing): it stays
                    self._all[oldest] = gone
            return
        entries = self._entries
        entries[signature] = entry
        while len(entries) > CACHE_SIZE:
            try:
                oldest = entries.popitem(last=False)[0]
            except KeyError:  # another thread emptied it meanwhile
                break
            gone = self._all.pop(oldest, None)
            if gone is not None and not gone[1]:  # replayed since (threads racing): its own tier evicts it
                self._all[oldest] = gone
