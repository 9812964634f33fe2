"""The serving engine's host side: requests, the KV-cache block pool and manager, the scheduler.

Everything re-exported here is pure Python (no jax), so the scheduler's tests run in
milliseconds; the device side (runner, sampling, engine loop) lives in its own modules and is
imported from them directly.
"""

from jaxinfer.engine.host.block_pool import NULL_BLOCK_ID, BlockPool, NoFreeBlocksError
from jaxinfer.engine.host.host_block_pool import HostBlockPool, KVTransfers
from jaxinfer.engine.host.kv_cache_manager import KVCacheManager, hash_block
from jaxinfer.engine.host.request import Request, RequestStatus
from jaxinfer.engine.host.scheduler import (
    RequestOutput,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    SchedulerOutput,
)

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "HostBlockPool",
    "KVCacheManager",
    "KVTransfers",
    "NoFreeBlocksError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerOutput",
    "hash_block",
]
