"""Over gloo (local CPU processes) a reduce-scatter costs an all-reduce; on NCCL rings half."""

import meshplan as mp
from meshplan.cost_models.comm import collective_time, group


def test_reduce_scatter_is_priced_as_run():
    cpu = mp.Cluster.preset("local-cpu")
    g = group(cpu, 4, 1)
    assert collective_time("reduce_scatter", 4e6, g, cpu) == collective_time("all_reduce", 4e6, g, cpu)
    h100 = mp.Cluster.preset("dgx-h100", nodes=1)
    g = group(h100, 8, 1)
    rs, ar = (collective_time(k, 1e9, g, h100) for k in ("reduce_scatter", "all_reduce"))
    assert rs < 0.8 * ar         # NVLS speeds the all-reduce up, so not quite half


def test_default_job_plans_plain_data_parallelism():
    """DDP's one all-reduce beats ZeRO-1's reduce-scatter + all-gather over gloo (issue 17: the
    default plan must be at least as fast as DDP by hand)."""
    plan = mp.plan(mp.models.build("tiny-llama", seq_len=128, device="meta"), mp.Cluster.preset("local-cpu"),
                   seq_len=128, global_batch=16)
    assert plan.layout.zero == 0 and plan.layout.dp == 4
