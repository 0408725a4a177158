"""Hand-written data parallelism and optimizer-state sharding, applied to a built model from outside."""

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.ddp_naive import DDPNaive
from cs336_systems.distributed.fsdp import FSDP, default_shard_policy, gather_full_params
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["DDPBucketed", "DDPIndividualParameters", "DDPNaive", "FSDP", "ShardedOptimizer", "default_shard_policy",
           "gather_full_params"]
