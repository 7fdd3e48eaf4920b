"""Test-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported, and torch may import triton on its
own, so the variable is set here, before any test module is collected. On a machine with an
NVIDIA GPU the real compiler is used instead. MESHPLAN_SPAWN_PRELOAD (below) is read when the
first multi-process test starts the fork server its ranks are forked from.
"""

import os

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"

# Ranks of the multi-process tests (meshplan.train.spawn.run_ranks) are forked from a server that
# imports torch once; these transformers models (and torchao, which transformers imports) too,
# instead of every rank importing them again (about 5 s of CPU each). Triton as well: every rank
# that runs a fused kernel imports it (0.2-0.3 s of CPU a rank, about a hundred ranks a session);
# the server inherits TRITON_INTERPRET from here, so its Triton is the interpreter's.
os.environ.setdefault("MESHPLAN_SPAWN_PRELOAD", ",".join(
    [f"transformers.models.{m}" for m in ("auto.modeling_auto", "llama.modeling_llama", "mixtral.modeling_mixtral",
                                           "qwen2_moe.modeling_qwen2_moe", "phi3.modeling_phi3", "gpt2.modeling_gpt2")]
    + ["triton", "triton.language", "triton.runtime.interpreter"]))


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tests that compute in this process (one-rank training runs, reference models) use tiny
    matmuls: a second intra-op thread gains nothing, and on a busy machine the threads' waiting
    for each other makes them many times slower (measured: a 100-step tiny-llama run 10x slower
    with 2 threads than with 1 on 2 cores shared with another job). Spawned ranks set 1 too."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def h100x8():
    """One DGX H100 node (8 GPUs)."""
    from meshplan.cluster import Cluster
    return Cluster.preset("dgx-h100", nodes=1)


@pytest.fixture(scope="module")
def h100x16():
    """Two DGX H100 nodes (16 GPUs)."""
    from meshplan.cluster import Cluster
    return Cluster.preset("dgx-h100", nodes=2)


@pytest.fixture(scope="module")
def one_process_group():
    """A one-rank gloo process group for the tests of a module that run the runtime in-process."""
    import torch.distributed as dist

    from meshplan.train.spawn import init_single_process_group
    if not init_single_process_group(120):
        pytest.skip("a process group is already initialised in this process")
    yield
    dist.destroy_process_group()


# The README's command runs the suite on two xdist workers, one module at a time each
# (--dist loadscope), handing out modules in collection order. Collected alphabetically, the
# longest modules (spawned multi-process worlds, training runs) come last, and the run ends with
# one worker finishing a long module while the other idles. These go first, longest first (their
# wall times in a `-n 2 --durations=0` run on 2 quiet cores, roughly 15-80 s each), so the short
# ones fill in at the end.
_LONGEST_FIRST = (
    "tests/runtime/test_plan_matrix.py", "tests/runtime/test_parallel_numerics.py", "tests/runtime/test_ep_folding.py",
    "tests/runtime/test_plan_contract.py", "tests/train/test_muon.py", "tests/train/test_train.py",
    "tests/runtime/test_context_parallel.py", "tests/runtime/test_tp_fused_projections.py",
    "tests/runtime/test_mtp_parallel.py", "tests/train/test_multinode.py", "tests/runtime/test_parallel_numerics_8.py",
    "tests/runtime/test_expert_parallel.py", "tests/runtime/test_deferred_init.py", "tests/export/test_export_tools.py",
    "tests/runtime/test_hf_moe_ep.py", "tests/train/test_batch_schedule.py", "tests/runtime/test_loss_parallel.py",
    "tests/runtime/test_fp8_one_rank.py", "tests/runtime/test_fp8.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    root = str(config.rootpath)

    def key(item):
        path = os.path.relpath(str(item.path), root)
        return rank.get(path, len(rank))
    items.sort(key=key)     # stable: the rest keep their order
