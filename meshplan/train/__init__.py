"""The training application around the parallel engine (meshplan.runtime): the training loop
(loop.py), data and batching (data.py, tokenizer.py, corpus/), the optimizer and LR schedule
(optim.py, lr_schedule.py), distributed checkpoints (checkpoint.py), metrics (metrics.py), and
process launch (launch.py: torchrun locally, Slurm on clusters; spawn.py: worker processes).

It reads a Plan and parallelises the model with meshplan.runtime.parallelize; it does not plan.
"""
