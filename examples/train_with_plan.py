"""Plan a tiny Llama for 4 processes, parallelise it with the plan, and train a few steps.

Run: torchrun --nproc-per-node 4 examples/train_with_plan.py
 or: meshplan launch --nproc 4 -- examples/train_with_plan.py
"""

import torch
import torch.distributed as dist

import meshplan as mp


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)                       # the same weights on every rank
    plan = mp.plan(mp.models.build("tiny-llama", device="meta"), mp.Cluster.preset("local-cpu"),
                   seq_len=128, global_batch=16, fixed={"tp": 2, "dp": 2})
    if dist.get_rank() == 0:
        print(plan.explain().splitlines()[1])
    model = mp.models.build("tiny-llama", device="cpu")
    model.init_weights()
    pm = mp.parallelize(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (16, 129), generator=g)
    for step in range(5):
        loss = pm.forward_backward(ids[:, :-1], ids[:, 1:])
        norm = pm.clip_grad_norm(1.0)
        opt.step()
        pm.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss:.3f} grad norm {norm:.2f}")
    full = pm.full_state_dict()
    if dist.get_rank() == 0:
        print(f"{len(full)} tensors in the full state dict")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
