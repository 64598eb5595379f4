"""Pipeline x context parallelism: a 2 (cp) x 2 (pp) DeviceMesh, each sequence split over two copies of the pipeline.

    torchrun --nproc-per-node 4 examples/context_parallel.py
    torchrun --nproc-per-node 4 examples/context_parallel.py --schedule zb-v   # any schedule pipefold knows
    python examples/context_parallel.py --reference                            # one process, whole sequences

Ranks 0 and 1 are one copy of the pipeline, ranks 2 and 3 the other (init_device_mesh numbers the ranks row by
row). Every rank is given the same whole batch: the Pipeline keeps its copy's share of each sequence (two of its
four chunks, an early and a late one), runs the GPT's attention as a ring over the two copies and its position
embedding at each token's place in the whole sequence, and averages the gradients over the copies. The model is
pipefold's GPT (pipefold.models), whose layers declare where attention and positions are. Both runs print
`step N loss X` (the whole batch's mean loss); the lines agree.
"""

import argparse

import torch
from torch import nn

from pipefold import Pipeline, split_model  # before init_process_group (docs/library.md, "After the step")
from pipefold.models.gpt import GPTConfig, build_gpt, gpt_loss


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=16, help="tokens a sequence: a multiple of 2 x cp = 4")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference", action="store_true", help="one process, no pipefold, whole sequences")
    return p


def model(args: argparse.Namespace, vocab: int = 64) -> list[nn.Module]:
    """The GPT as a list of layers (embedding, blocks, head), the same weights on every rank (one seed)."""
    cfg = GPTConfig(vocab_size=vocab, block_size=args.length, n_layer=args.blocks, n_head=4, n_embd=args.width)
    return build_gpt(cfg, seed=0)


def batches(vocab: int, batch: int, length: int, seed: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = (torch.randint(0, vocab, (batch, 1), generator=g)
                  + torch.randint(0, 3, (batch, length + 1), generator=g).cumsum(1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def pipelined(layers: list[nn.Module], args: argparse.Namespace, mesh):  # noqa: ANN001, ANN201
    """This rank's stages of the GPT in a Pipeline over ``mesh`` (dimensions "cp" and "pp")."""
    stages = split_model(layers, args.schedule, devices=mesh["pp"].size(), microbatches=args.microbatches,
                         device=mesh["pp"].get_local_rank())
    return Pipeline(stages, args.schedule, microbatches=args.microbatches, loss_fn=gpt_loss, mesh=mesh)


def main() -> None:
    args = parser().parse_args()
    layers = model(args)
    data = batches(64, args.batch, args.length, seed=1)

    if args.reference:
        whole, pipe, rank = nn.Sequential(*layers), None, 0
        params = list(whole.parameters())
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "pp"))
        pipe = pipelined(layers, args, mesh)
        params = pipe.parameters()

    opt = torch.optim.AdamW(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    for step in range(args.steps):
        x, y = next(data)  # the whole sequences, on every rank alike
        opt.zero_grad()
        if pipe is None:
            loss_t = gpt_loss(whole(x), y)
            loss_t.backward()
            loss = loss_t.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            loss = pipe.step(x, target=y, all_ranks=True)  # the whole sequences' mean loss, on every rank
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
