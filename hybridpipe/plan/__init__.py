"""The planner: profile a model once, then pick stages × replicas, balance, micro-batches, schedule and
re-materialization for a cluster by simulating each candidate's schedule (see docs/planner.md).

Example:
    >>> profile = hp.plan.profile(layers, sample_x, loss_fn, sample_y)          # one process
    >>> cluster = hp.plan.Cluster(ranks=8, ranks_per_host=4, inter_host_gbps=10)
    >>> best = hp.plan.plan(profile, cluster, global_batch=256)
    >>> model = hp.PipelineModel(layers, loss_fn, **best.model_arguments())      # under mpirun -n 8
    >>> opt = hp.DistributedOptimizer(torch.optim.AdamW(model.parameters()), **best.optimizer_arguments())
"""

from hybridpipe.plan.cost import (Candidate, Cluster, Prediction, allgather_seconds, allreduce_seconds, memory_per_rank,
                                  predict, reducescatter_seconds, step_lower_bound)
from hybridpipe.plan.module_profile import profile_module
from hybridpipe.plan.profile import LayerCost, Profile, profile
from hybridpipe.plan.search import Plan, plan, plans

__all__ = ["Candidate", "Cluster", "LayerCost", "Plan", "Prediction", "Profile", "allgather_seconds",
           "allreduce_seconds", "memory_per_rank", "plan", "plans", "predict", "profile", "profile_module",
           "reducescatter_seconds", "step_lower_bound"]
