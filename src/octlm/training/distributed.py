"""Several processes on PyTorch's own engines: the process group, the model's wrapping, state.

Under ``torchrun`` a run uses its ``W`` processes one of three ways:

- ``ddp`` (default): each rank takes ``B / W`` rows of the global batch of ``B``;
  ``DistributedDataParallel`` averages the gradients, so one step equals one process's step
  on the whole batch.
- ``fsdp``: the same split, with parameters, gradients and optimizer state sharded by FSDP2
  (``fully_shard`` on every block, then on the model).
- ``context``: every rank takes the whole batch but only its zigzag shard of the positions;
  ring attention passes keys and values around (:mod:`octlm.context_parallel`), and the
  ranks' shares of the loss and of the gradients add up to one process's.

State goes in and out as full, unsharded dicts keyed by parameter name
(``torch.distributed.checkpoint.state_dict``), so every mode reads every mode's checkpoints.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from octlm.context_parallel import reduce_gradients
from octlm.model import OctLM
from octlm.training.config import local_device

MODES = ("single", "ddp", "fsdp", "context")
T = TypeVar("T")


@dataclass(frozen=True)
class Cluster:
    """This process's place: rank, world size, device, how the ranks share the work."""

    rank: int
    world: int
    device: torch.device
    mode: str
    owns_group: bool  # this run initialised the process group, and so destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_ranks(self) -> int:
        """How many ranks split the batch's rows between them."""
        return self.world if self.mode in ("ddp", "fsdp") else 1

    def rows(self, tensor: Tensor) -> Tensor:
        """This rank's rows ``(B / data_ranks, ...)`` of a global batch ``(B, ...)``."""
        if self.data_ranks == 1:
            return tensor
        return tensor.chunk(self.world)[self.rank]

    def total(self, value: Tensor) -> Tensor:
        """The whole batch's value of a per-rank loss: mean over data ranks, sum of CP shares."""
        if self.world == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.data_ranks

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (so all ranks stop together)."""
        if self.world == 1:
            return flag
        vote = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(vote)
        return bool(vote.item())

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (a collective)."""
        if self.world == 1:
            return [obj]
        found = [None] * self.world
        dist.all_gather_object(found, obj)
        return found

    def on_main(self, work: Callable[[], T]) -> T:
        """Run ``work`` on rank 0 and return its result on every rank; its ValueError or OSError
        (a full disk) too, so no rank waits for one that has failed."""
        result = None
        if self.is_main:
            try:
                result = ("ok", work())
            except ValueError as error:
                result = ("error", str(error))
            except OSError as error:
                result = ("os", (error.errno, error.strerror, error.filename))
        result = self.share(result)
        if result[0] == "error":
            raise ValueError(result[1])
        if result[0] == "os":
            raise OSError(*result[1])
        return result[1]

    def share(self, obj):
        """Rank 0's ``obj`` on every rank (a collective)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def setup(device: str | None, *, fsdp: bool, context_parallel: bool) -> Cluster:
    """Join torchrun's process group when there is one; pick the device and the mode.

    A process group initialised by the caller is used as it is (and left for it to destroy).
    """
    device = local_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    owns_group = False
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and under_torchrun:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns_group = True
    if not dist.is_initialized():
        if fsdp or context_parallel:
            flag = "--fsdp" if fsdp else "--context-parallel"
            raise ValueError(
                f"{flag} needs several processes: launch with torchrun --nproc-per-node N "
                "-m octlm train ..."
            )
        return Cluster(0, 1, device, "single", owns_group=False)
    mode = "fsdp" if fsdp else "context" if context_parallel else "ddp"
    return Cluster(dist.get_rank(), dist.get_world_size(), device, mode, owns_group)


def teardown(cluster: Cluster) -> None:
    """Destroy the process group this run initialised; call it once the run's wrappers of the
    model are dropped (:meth:`octlm.training.loop.Training.unwrap`).

    DDP's reducer holds the group from C++ and, were it the last holder, would destroy the
    group without releasing the GIL. The group's destructor joins gloo's worker threads, and
    one of them may still be freeing the tensors of the last collective, for which it needs
    the GIL: the process would hang at exit. So the wrappers go first, a collection frees any
    left in a reference cycle while the group lives, and the last holder is the group's own
    Python object, whose destructor releases the GIL.
    """
    if cluster.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def shard(model: OctLM, cluster: Cluster) -> None:
    """Under FSDP, shard every block's parameters and then the rest (in place)."""
    if cluster.mode == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)


def wrap(model: OctLM, cluster: Cluster) -> nn.Module:
    """The module the loop calls: DDP around the model, or the (sharded) model itself."""
    if cluster.mode == "ddp":
        device_ids = [cluster.device] if cluster.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce of micro-batches before the last of an accumulated step."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def finish_gradients(model: OctLM, cluster: Cluster) -> None:
    """Under context parallelism, add the ranks' shares of the gradients."""
    if cluster.mode == "context":
        reduce_gradients(model)


def full_state(model: OctLM, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state dicts keyed by parameter name (a collective)."""
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_state(
    model: OctLM, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load :func:`full_state`'s dicts into a plain or sharded model and its optimizer."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=StateDictOptions(full_state_dict=True),
    )
