"""The FSDP settings of configs/shakespeare-fsdp.yaml, checked on the CPU as far as it goes.

Composer 0.32.1 wraps FSDP with ``device_id=torch.cuda.current_device()``, so a Composer FSDP run
needs GPUs. What does not: two gloo processes wrap the model the way Composer does (a
``CustomPolicy`` over the ``_fsdp_wrap`` marks of :func:`llm.train.builders.mark_fsdp_units`,
activation checkpointing where ``_activation_checkpointing`` is set) with the config's sharding
strategy, and one sharded SGD step on half a batch each must equal one unsharded step on the
whole batch.
"""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf

from llm import MosaicGPTConfig
from llm.train.composer_model import ComposerMosaicGPT
from llm.train.builders import mark_fsdp_units

REPO = Path(__file__).resolve().parents[2]
FSDP_CFG = OmegaConf.to_container(OmegaConf.load(REPO / "configs/shakespeare-fsdp.yaml").parallelism_config.fsdp)


def tiny():
    torch.manual_seed(0)
    config = MosaicGPTConfig(vocab_size=97, max_seq_len=32, d_model=32, n_heads=4, n_layers=3, rope=True,
                             learned_pos_emb=False, init_std=0.1)
    return ComposerMosaicGPT(config)


def batch():
    return torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))


def sgd_step(model, ids, lr=0.5):
    loss = F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()  # skips parameters sharded to the other rank
    return loss.detach()


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    composer_model = tiny()
    mark_fsdp_units(composer_model, activation_checkpointing=FSDP_CFG["activation_checkpointing"])
    wrapped = FSDP(
        composer_model.model,
        auto_wrap_policy=CustomPolicy(lambda module: bool(getattr(module, "_fsdp_wrap", False))),
        sharding_strategy=ShardingStrategy[FSDP_CFG["sharding_strategy"]],
        use_orig_params=FSDP_CFG["use_orig_params"],
        limit_all_gathers=FSDP_CFG["limit_all_gathers"],
        device_id=torch.device("cpu"),
    )
    if FSDP_CFG["activation_checkpointing"]:
        apply_activation_checkpointing(wrapped, check_fn=lambda m: getattr(m, "_activation_checkpointing", False))
    ids = batch().chunk(world)[rank]
    loss = sgd_step(wrapped, ids)  # FSDP averages the gradients over the ranks
    dist.all_reduce(loss)
    with FSDP.summon_full_params(wrapped):
        state = {name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): p.detach().clone()
                 for name, p in wrapped.named_parameters()}
    units = sum(isinstance(m, FSDP) for m in wrapped.modules())
    if rank == 0:
        torch.save({"loss": loss / world, "state": state, "units": units}, out)
    dist.destroy_process_group()


def test_fsdp_settings_shard_a_step_like_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path / "fsdp.pt")), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "fsdp.pt")

    reference = tiny().model
    loss = sgd_step(reference, batch())
    assert sharded["units"] == reference.config.n_layers + 1  # each block, and the rest of the model
    assert float(sharded["loss"]) == pytest.approx(float(loss), abs=1e-5)
    expected = dict(reference.named_parameters())
    assert sharded["state"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(sharded["state"][name], value.detach(), atol=1e-5, rtol=1e-5, msg=name)
