"""The types every layer of meshplan shares: the bottom floor of the package.

    ModelProfile / BlockProfile   what the tracer produces and the cost model reads (profile.py)
    Layout                        parallel degrees and execution choices (layout.py)
    Estimate                      the cost model's prediction for one layout (estimate.py)
    Plan                          the contract between planner and runtime (plan.py)
    runtime_limits, ModelTraits   what the runtime can run, read by planner and runtime (support.py)

Nothing here imports any other part of meshplan except `meshplan.errors` (enforced by
tests/test_architecture.py), so the runtime can read a Plan without importing the planner.
"""
