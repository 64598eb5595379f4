"""A Hugging Face LlamaForCausalLM, cut by hand into pipeline stages, trained with pipefold in its own loop.

    torchrun --nproc-per-node 2 examples/hf_llama.py                    # pipelined, 1F1B
    python examples/hf_llama.py --reference                             # the unmodified model in one process

Stage 0 holds the embeddings and the first decoder layers, the middle stages decoder layers, the last stage the
rest of the layers, the final norm and lm_head. Between stages travels a dict, {"hidden_states", "position_ids"},
spread as keyword arguments into the next stage; each stage makes the rotary embeddings and the causal mask from
them as LlamaModel.forward does. Both runs print `step N loss X`; the lines agree.
"""

import argparse

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask


class LlamaStage(nn.Module):
    """Decoder layers ``layers[lo:hi]`` of ``model``, with the embeddings on the first stage and norm + lm_head on
    the last."""

    def __init__(self, model: LlamaForCausalLM, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, input_ids=None, hidden_states=None, position_ids=None):  # noqa: ANN001, ANN201
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(input_ids)
            b, t = input_ids.shape
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden_states, attention_mask=None,
                                  cache=None, position_ids=position_ids)
        rotary = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=rotary,
                                  position_ids=position_ids)
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden_states))
        return {"hidden_states": hidden_states, "position_ids": position_ids}


def batches(vocab: int, batch: int, length: int, seed: int):  # noqa: ANN201
    """Token sequences: random walks over the vocabulary, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        yield (start + torch.randint(-2, 3, (batch, length), generator=g).cumsum(1)) % vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedule", default="1f1b", help="a schedule with one stage per rank (1f1b, gpipe, zb-h1, ...)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reference", action="store_true", help="the unmodified LlamaForCausalLM in one process")
    args = p.parse_args()

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    data = batches(config.vocab_size, args.batch, args.length, seed=1)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)  # shifts the labels

    if args.reference:
        pipe, rank, params = None, 0, list(model.parameters())
    else:
        import torch.distributed as dist

        from pipefold import Pipeline

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        layers = config.num_hidden_layers
        cut = [layers * d // world for d in range(world + 1)]  # stage d: decoder layers cut[d]..cut[d+1]
        stage = LlamaStage(model, cut[rank], cut[rank + 1], first=rank == 0, last=rank == world - 1)
        pipe = Pipeline(stage, args.schedule, microbatches=args.microbatches, loss_fn=loss_fn)
        params = pipe.parameters()

    opt = torch.optim.AdamW(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    for step in range(args.steps):
        tokens = next(data)
        opt.zero_grad()
        if pipe is None:
            out = model(input_ids=tokens, labels=tokens)
            out.loss.backward()
            loss = out.loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            loss = pipe.step(input_ids=tokens, target=tokens, all_ranks=True)
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
