"""Train the small model context-parallel: each process holds 1/W of every sequence.

On one CPU machine, four processes, gloo backend::

    torchrun --nproc-per-node 4 examples/train_context_parallel.py

Every rank builds the same model from the same seed and draws the same batches of byte tokens;
each keeps its zigzag shard of the positions (:mod:`octlm.context_parallel`) and ring
attention passes keys and values between the ranks. The ranks' losses add up to the
single-process loss and their summed gradients equal the single-process ones, so every rank
takes the same optimizer step. Rank 0 prints the loss of each step and, first, the loss the
same batch gets in one process, for comparison. The sequence length must be a multiple of
twice the process count.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from octlm.context_parallel import context_parallel_loss, reduce_gradients
from octlm.lab.verify.loss_curve import load_text
from octlm.model import ModelConfig, OctLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence, all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(
        vocab_size=256, width=128, n_layers=2, n_heads=4, n_kv_heads=2,
        max_length=args.length, attention="ring",
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    model = OctLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.frombuffer(bytearray(load_text()), dtype=torch.uint8).long()
    offsets = torch.arange(args.length + 1)  # (T + 1,)
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank

    for step in range(args.steps):
        starts = torch.randint(len(data) - args.length, (args.batch, 1), generator=generator)
        windows = data[starts + offsets]  # (B, T + 1)
        inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
        if step == 0 and rank == 0:
            single = OctLM(replace(config, attention="sdpa"))
            single.load_state_dict(model.state_dict())
            with torch.no_grad():
                logits = single(inputs).flatten(0, 1)  # (B*T, V)
                single_loss = F.cross_entropy(logits, targets.flatten())
            print(f"single process, step 0: loss {single_loss.item():.4f}")
        began = time.perf_counter()
        loss = context_parallel_loss(model, inputs, targets)  # this rank's share
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_gradients(model)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the single-process loss
        if rank == 0:
            seconds = time.perf_counter() - began
            print(f"{world} ranks, step {step}: loss {total.item():.4f} ({seconds:.2f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
