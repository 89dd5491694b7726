"""KV caches: the static arena (memory, staging, commit / rollback) and the policies that choose what to keep."""

from .arena import POSITION_MODES, KVArena
from .policy import POLICIES, CachePolicy, make_policy

__all__ = ["POSITION_MODES", "POLICIES", "CachePolicy", "KVArena", "make_policy"]
