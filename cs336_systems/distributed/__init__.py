"""Hand-written data parallelism, optimizer-state sharding and fully-sharded data parallelism, applied to a
built model from outside (`apply_data_parallel(model, DataParallelSpec.parse("bucketed:25+sharded"), device)`)."""

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.ddp_naive import DDPNaive
from cs336_systems.distributed.fsdp import FSDP, default_shard_policy, gather_full_params
from cs336_systems.distributed.parallelize import (
    DataParallel,
    DataParallelSpec,
    NoDataParallel,
    ParallelPlan,
    TorchDDP,
    apply_data_parallel,
    build_optimizer,
    parallelize,
)
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["DDPBucketed", "DDPIndividualParameters", "DDPNaive", "DataParallel", "DataParallelSpec", "FSDP",
           "NoDataParallel", "ParallelPlan", "ShardedOptimizer", "TorchDDP", "apply_data_parallel", "build_optimizer",
           "default_shard_policy", "gather_full_params", "parallelize"]
