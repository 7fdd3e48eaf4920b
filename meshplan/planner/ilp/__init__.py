"""The planner's integer programs and their parts: intra-block sharding (sharding*.py),
pipeline stage splits (stages.py, stage_*.py), FP8 placement (fp8.py), and the MILP solver
they share (solver.py)."""
