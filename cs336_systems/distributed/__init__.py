"""Hand-written data parallelism and optimizer-state sharding, applied to a built model from outside
(`apply_data_parallel(model, DataParallelSpec.parse("bucketed:25+sharded"), device)`)."""

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.ddp_naive import DDPNaive
from cs336_systems.distributed.parallelize import (
    DataParallel,
    DataParallelSpec,
    NoDataParallel,
    TorchDDP,
    apply_data_parallel,
    build_optimizer,
)
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["DDPBucketed", "DDPIndividualParameters", "DDPNaive", "DataParallel", "DataParallelSpec", "NoDataParallel",
           "ShardedOptimizer", "TorchDDP", "apply_data_parallel", "build_optimizer"]
