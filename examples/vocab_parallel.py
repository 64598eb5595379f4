"""Vocabulary Parallelism in your own loop: the GPT's output projection and token embedding split by vocabulary over
every rank.

    torchrun --nproc-per-node 2 examples/vocab_parallel.py
    torchrun --nproc-per-node 2 examples/vocab_parallel.py --schedule 1f1b:vocab=1   # any schedule with vocab=1
    python examples/vocab_parallel.py --reference                                     # one process, no pipefold

The last layer of the GPT is its final norm and its projection onto the vocabulary. The projection is taken out of
it (``lm_head`` becomes the identity, so the last stage ends with the norm and returns the hidden states), and each
rank keeps its rows of it, a ``VocabShard``: rank r holds rows r x V/p to (r+1) x V/p (the vocabulary padded to a
multiple of p, here 1000 entries over 2 ranks). The schedule places each shard's passes beside the stages' own;
the loss is the mean cross entropy over every position, as ``gpt_loss`` computes it in one process. The token
embedding splits the same way (``wte`` becomes the identity, so the first stage adds the positions to the embeddings
it is given). Every rank is given the tokens and the targets: each looks up its rows and computes its shard's part
of the loss. Both runs print ``step N loss X``; the lines agree.
"""

import argparse

import torch
from torch import nn

from pipefold.models.gpt import GPTConfig, build_gpt, gpt_loss


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedule", default="v-half:vocab=1")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference", action="store_true", help="one process, no pipefold")
    return p


def batches(vocab: int, batch: int, length: int, seed: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = (torch.randint(0, vocab, (batch, 1), generator=g)
                  + torch.randint(0, 3, (batch, length + 1), generator=g).cumsum(1)) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    args = parser().parse_args()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.length, n_layer=args.blocks, n_head=4, n_embd=args.width)
    layers = build_gpt(cfg, seed=0)  # the same weights on every rank (one seed)
    data = batches(args.vocab, args.batch, args.length, seed=1)

    if args.reference:
        whole, pipe, rank = nn.Sequential(*layers), None, 0
        params = list(whole.parameters())
    else:
        import torch.distributed as dist

        from pipefold import Pipeline, VocabShard, split_model

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        head = layers[-1]
        shard = VocabShard.of(head.lm_head.weight, rank, world)  # this rank's rows of the projection
        head.lm_head = nn.Identity()  # the last stage ends with the final norm
        embedding = VocabShard.of(layers[0].wte.weight, rank, world)  # and its rows of the token embedding
        layers[0].wte = nn.Identity()  # the first stage is given the embeddings
        stages = split_model(layers, args.schedule, devices=world, microbatches=args.microbatches, device=rank)
        pipe = Pipeline(stages, args.schedule, microbatches=args.microbatches, vocab=shard, embedding=embedding)
        params = pipe.parameters()  # its stages' and its shards'

    opt = torch.optim.AdamW(params, lr=args.lr)
    for step in range(args.steps):
        x, y = next(data)
        opt.zero_grad()
        if pipe is None:
            loss_t = gpt_loss(whole(x), y)
            loss_t.backward()
            loss = loss_t.item()
        else:
            loss = pipe.step(x, target=y, all_ranks=True)  # the tokens and the targets on every rank
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss:.8f}", flush=True)

    if pipe is not None:
        pipe.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
