"""Pipeline x tensor parallelism: a 2 (pp) x 2 (tp) DeviceMesh, each block split with torch's parallelize_module.

    torchrun --nproc-per-node 4 examples/tp_pp.py
    torchrun --nproc-per-node 4 examples/tp_pp.py --sequence-parallel  # the blocks' norms on half the tokens each
    python examples/tp_pp.py --reference                                # one process, the whole model

Ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1 (init_device_mesh numbers the ranks row by row). In every
block the up projection is split by columns (ColwiseParallel) and the down projection by rows (RowwiseParallel,
which sums the two halves); embedding, norms and head stay whole on each tp rank. Each tp rank is its own
pipeline member along "pp", and every rank sees the whole batch. Both runs print `step N loss X`; they agree.

With --sequence-parallel each block's norm and residual run on the rank's half of the tokens (SequenceParallel),
the up projection gathers the tokens first and the down projection reduce-scatters them after. A stage's first
block takes its input whole and keeps its half of the tokens, its last gathers its output whole again: the
pipeline sends and receives what it does without sequence parallelism.
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
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference", action="store_true", help="one process, no pipefold, no tensor parallelism")
    p.add_argument("--sequence-parallel", action="store_true", help="each block's norm on the rank's tokens")
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
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        from pipefold import Pipeline, split_model

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        stages = split_model(layers, args.schedule, devices=mesh["pp"].size(), microbatches=args.microbatches,
                             device=mesh["pp"].get_local_rank())
        tp = mesh["tp"]
        for stage in stages.values():
            blocks = [layer for layer in stage if isinstance(layer, Block)]
            for layer in blocks:
                if not args.sequence_parallel:
                    parallelize_module(layer, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
                    continue
                parallelize_module(layer, tp, {"norm": SequenceParallel(),
                                               "up": ColwiseParallel(input_layouts=Shard(1)),
                                               "down": RowwiseParallel(output_layouts=Shard(1))})
            if args.sequence_parallel and blocks:  # the stage's blocks are consecutive: tokens split between them
                parallelize_module(blocks[0], tp, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                     desired_input_layouts=(Shard(1),),
                                                                     use_local_output=True))
                parallelize_module(blocks[-1], tp, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                                       desired_output_layouts=(Replicate(),)))
        pipe = Pipeline(stages, args.schedule, microbatches=args.microbatches, loss_fn=loss_fn, mesh=mesh)
        params = pipe.parameters()

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
            loss = pipe.step(x, target=y, all_ranks=True)  # on every rank of this rank's pipeline
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
