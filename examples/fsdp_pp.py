"""Pipeline x FSDP2: a 2 (dp) x 2 (pp) DeviceMesh, each stage module sharded with fully_shard over "dp".

    torchrun --nproc-per-node 4 examples/fsdp_pp.py
    python examples/fsdp_pp.py --reference                              # one process, the whole batch

Ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1 (init_device_mesh numbers the ranks row by row). Each data-
parallel copy trains on its own half of every batch; FSDP reduce-scatters the gradients, so the step is that of
the whole batch in one process. Both runs print `step N loss X` (the whole batch's loss); the lines agree.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model(vocab: int, width: int, blocks: int) -> list[nn.Module]:
    """A token model as a list of layers: embedding, residual MLP blocks, norm and head."""
    return [nn.Embedding(vocab, width), *(Block(width) for _ in range(blocks)),
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))]


def batches(vocab: int, batch: int, length: int, seed: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = (torch.randint(0, vocab, (batch, 1), generator=g)
                  + torch.randint(0, 3, (batch, length + 1), generator=g).cumsum(1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference", action="store_true", help="one process, no pipefold, the whole batch")
    args = p.parse_args()

    torch.manual_seed(0)
    vocab = 64
    layers = model(vocab, width=32, blocks=4)
    data = batches(vocab, args.batch, length=16, seed=1)

    if args.reference:
        whole, pipe, rank = nn.Sequential(*layers), None, 0
        params = list(whole.parameters())
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from pipefold import Pipeline, split_model

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        stages = split_model(layers, args.schedule, devices=mesh["pp"].size(), microbatches=args.microbatches,
                             device=mesh["pp"].get_local_rank())
        for stage in stages.values():
            fully_shard(stage, mesh=mesh["dp"])
        pipe = Pipeline(stages, args.schedule, microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh)
        params = pipe.parameters()  # the shards: made after the Pipeline

    opt = torch.optim.AdamW(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    for step in range(args.steps):
        x, y = next(data)
        opt.zero_grad()
        if pipe is None:
            loss_t = loss_fn(whole(x), y)
            loss_t.backward()
            loss = loss_t.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            half = slice(dp_rank * len(x) // dp, (dp_rank + 1) * len(x) // dp)  # this copy's part of the batch
            mine = pipe.step(x[half], target=y[half], all_ranks=True)
            summed = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(summed, group=mesh["dp"].get_group())  # the whole batch's loss: the copies' mean
            loss = summed.item() / dp
            pipe.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        if rank == 0:
            print(f"step {step} loss {loss:.8f}", flush=True)

    if pipe is not None:
        pipe.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
