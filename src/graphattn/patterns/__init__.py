"""Pattern matchers: find the fusable subgraphs of a graph (structure only, no kernel details)."""
from .sdpa import SdpaMatch, match_sdpa

__all__ = ["SdpaMatch", "match_sdpa"]
