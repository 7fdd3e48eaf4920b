"""Workers for deferred-initialisation tests (imported by spawned ranks)."""

from __future__ import annotations

import resource

import torch


def reference_model(kind: str, seq_len: int, seed: int, **over):
    """The single-device model deferred initialisation must reproduce: built on meta, allocated
    on the CPU and initialised there under `seed`."""
    from meshplan import models
    torch.manual_seed(seed)
    m = models.build(kind, seq_len=seq_len, device="meta", **over).to_empty(device="cpu")
    m.init_weights()
    return m


def deferred_run(rank: int, world: int, case: dict) -> dict:
    import numerics
    from meshplan import models
    from meshplan.runtime.parallel import parallelize
    torch.manual_seed(case["seed"])
    meta = models.build(case["kind"], seq_len=case["seq_len"], device="meta", **case.get("over", {}))
    pm = parallelize(meta, case["plan"], compute_dtype=None)
    assert not any(p.device.type == "meta" for st in pm.stages for p in st.parameters())
    rng_after = torch.get_rng_state()
    full = pm.full_state_dict()
    x, y = numerics.batch(case["batch"], case["seq_len"])
    loss = pm.forward_backward(x, y)
    return {"state": {k: v.cpu() for k, v in full.items()} if rank == 0 else None, "loss": loss,
            "rng_after": rng_after if rank == 0 else None}


def big_model_run(rank: int, world: int, case: dict) -> dict:
    """Train steps of a model whose full fp32 state does not fit one rank's share; report peak RSS."""
    from meshplan import models
    from meshplan.runtime.parallel import parallelize
    torch.manual_seed(0)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # noqa: E731
    # warm-up on a tiny model through the same path: libraries loaded on first use, thread pools
    # and allocator arenas are the process's, not the model's
    tiny = models.build(case["kind"], seq_len=case["seq_len"], device="meta")
    warm = parallelize(tiny, case["warm_plan"], compute_dtype=None)
    ids = torch.randint(0, 256, (case["batch"], case["seq_len"] + 1))
    warm.forward_backward(ids[:, :-1], ids[:, 1:])
    del warm, tiny
    import gc
    gc.collect()
    before = rss()
    meta = models.build(case["kind"], seq_len=case["seq_len"], device="meta", **case["over"])
    pm = parallelize(meta, case["plan"], compute_dtype=None)
    marks = {"parallelized": rss()}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(case["steps"]):
        ids = torch.randint(0, case["vocab"], (case["batch"], case["seq_len"] + 1), generator=g)
        losses.append(pm.forward_backward(ids[:, :-1], ids[:, 1:]))
        marks.setdefault("fwd_bwd", rss())
        opt.step()
        pm.zero_grad()
        marks.setdefault("step", rss())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pm.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"losses": losses, "peak_rss": peak, "rss_at_start": before, "local_params": local,
            "marks": {k: (v - before) / 1e6 for k, v in marks.items()}}


class _CountingFile:
    """A safetensors file handle that counts the elements read through it."""

    def __init__(self, sf, counter: dict):
        self.sf, self.counter = sf, counter

    def keys(self):
        return self.sf.keys()

    def get_tensor(self, key):
        t = self.sf.get_tensor(key)
        self.counter["elements"] += t.numel()
        return t

    def get_slice(self, key):
        sl, counter = self.sf.get_slice(key), self.counter

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, idx):
                t = sl[idx]
                counter["elements"] += t.numel()
                return t
        return Slice()


def safetensors_run(rank: int, world: int, case: dict) -> dict:
    """Load a transformers-style safetensors directory into a sharded meta-initialised model,
    counting the elements this rank reads from disk."""
    import contextlib

    from meshplan import models
    from meshplan.runtime.parallel import parallelize
    from meshplan.train import checkpoint
    counter = {"elements": 0}
    original = checkpoint._safe_open
    real = original()

    @contextlib.contextmanager
    def counting_open(path, framework):
        with real(path, framework=framework) as sf:
            yield _CountingFile(sf, counter)
    torch.manual_seed(case["seed"] + 1)           # other initial weights than the file's
    if case["kind"].startswith("hf"):
        import numerics
        with torch.device("meta"):
            meta = numerics.build_model(case["kind"], seq_len=case["seq_len"])
    else:
        meta = models.build(case["kind"], seq_len=case["seq_len"], device="meta")
    pm = parallelize(meta, case["plan"], compute_dtype=None)
    checkpoint._safe_open = lambda: counting_open
    try:
        checkpoint.load_weights(case["dir"], pm)
    finally:                                      # the next case in this process opens its own files
        checkpoint._safe_open = original
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pm.parameters())
    full = pm.full_state_dict()
    return {"state": {k: v.cpu() for k, v in full.items()} if rank == 0 else None,
            "read": counter["elements"], "local": local}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    """Every case in one process group: deferred_run, or safetensors_run (case["run"])."""
    from worlds import each_case
    runs = {"safetensors": safetensors_run, "deferred": deferred_run}
    return each_case(rank, cases, lambda name, case: runs[case.get("run", "deferred")](rank, world, case))
