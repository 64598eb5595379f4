"""A small GPT trained with pipefold inside its own loop.

    torchrun --nproc-per-node 2 examples/nanogpt.py                     # pipelined, 1F1B
    torchrun --nproc-per-node 2 examples/nanogpt.py --schedule zb-v     # any schedule pipefold knows
    torchrun --nproc-per-node 2 examples/nanogpt.py --schedule zb-v --dtype bf16 --compile   # bf16, compiled layers
    python examples/nanogpt.py --reference                              # the same loop in one process
    python examples/nanogpt.py --reference --dtype bf16 --compile       # ... in bf16, compiled

Both print `step N loss X` for every step; the lines agree (tests/test_examples_library.py checks it).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(vocab: int, width: int, heads: int, blocks: int, context: int) -> list[nn.Module]:
    """The model as a list of layers: embedding, blocks, final norm and head."""
    return [Embed(vocab, width, context), *(Block(width, heads) for _ in range(blocks)), Head(vocab, width)]


def token_stream(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A synthetic 'text': a random walk over the vocabulary with small steps (so there is something to learn)."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-2, 3, (length,), generator=g)
    return torch.cumsum(steps, 0) % vocab


def batches(stream: torch.Tensor, batch: int, context: int, seed: int):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=g)
        x = torch.stack([stream[s:s + context] for s in starts])
        y = torch.stack([stream[s + 1:s + context + 1] for s in starts])
        yield x, y


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the forwards under autocast to bf16")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer")
    p.add_argument("--reference", action="store_true", help="one process, no pipefold")
    args = p.parse_args()
    low = torch.bfloat16 if args.dtype == "bf16" else None

    torch.manual_seed(0)
    vocab = 64
    layers = gpt(vocab, args.width, heads=2, blocks=args.blocks, context=args.context)
    data = batches(token_stream(vocab, 10_000, seed=1), args.batch, args.context, seed=2)

    if args.reference:
        # Each layer compiled as pipefold compiles it (the Linears outside the compiled regions: pipefold's way of
        # keeping the backward split into B and W), and autocast around the forward.
        from pipefold.runtime.compiled import compile_stage

        model = compile_stage(nn.Sequential(*layers)) if args.compile else nn.Sequential(*layers)
        pipe, rank = None, 0
        params = list(model.parameters())
    else:
        import torch.distributed as dist

        from pipefold import Pipeline, split_model

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        stages = split_model(layers, args.schedule, devices=dist.get_world_size(), microbatches=args.microbatches)
        pipe = Pipeline(stages, args.schedule, microbatches=args.microbatches, loss_fn=loss_fn,
                        precision=args.dtype, compile=args.compile)
        params = pipe.parameters()

    make = lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.1)  # noqa: E731
    # pipe.optimizer: the optimizer for the pipeline's precision (fp16: it skips a step whose gradients overflowed).
    opt = make(params) if pipe is None else pipe.optimizer(make)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt if pipe is None else opt.optimizer, T_max=args.steps,
                                                       eta_min=args.lr / 10)
    m = args.microbatches
    for step in range(args.steps):
        x, y = next(data)
        opt.zero_grad()
        if pipe is None:  # the batch's microbatches one after the other, as the pipeline runs them
            loss = 0.0
            for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                with torch.autocast("cpu", dtype=low, enabled=low is not None):
                    loss_t = loss_fn(model(xs), ys)
                (loss_t / m).backward()
                loss += loss_t.item() / m
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        else:
            loss = pipe.step(x, target=y, all_ranks=True)  # the batch's mean loss, here on every rank
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
