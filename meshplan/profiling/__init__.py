"""A model's profile: the tracer (trace.py and its parts), the analytic profile from a config
(analytic.py), the fused-kernel matcher (fusions.py), the model traits the planner reads
(traits.py), the tensor-parallel probe (tp_probe.py) and the TP placements by linear role it
shares with the Plan (tp_roles.py). Below the planner: nothing here imports `meshplan.planner`."""
