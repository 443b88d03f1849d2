"""The README's main job: shard a tiny HF Llama with TP, train it functionally, and compare
every step's loss with the unsharded model trained the same way in the same process."""

from __future__ import annotations

__all__ = ["train"]

import torch
import torch.distributed as dist


def tiny_llama(seed: int = 0):
    """A small random-weight LlamaForCausalLM (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=128, attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def train(steps: int = 8, lr: float = 0.2, device: str = "cpu") -> list[tuple[float, float]]:
    """Runs on every rank: returns [(sharded loss, reference loss)] per step."""
    import optree
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm

    from ..core.gather import unshard
    from ..core.host_comm import broadcast_
    from ..plan.plan import ShardingPlan
    from ..runtime.shard import shard

    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = tiny_llama().to(device)
    with torch.no_grad():  # the same weights on every rank
        for p in model.parameters():
            broadcast_(p, src=0)
    plan = ShardingPlan.from_hf(model)
    apply_fn, params, shard_info = shard(model, plan, mesh)
    params = optree.tree_map(lambda p: p.detach(), params)
    ref_params = {k: p.detach() for k, p in model.named_parameters()}

    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, model.config.vocab_size, (4, 32), generator=gen).to(device)  # memorised: loss falls

    def loss_fn(p, batch):
        return apply_fn(p, input_ids=batch, labels=batch).loss

    def ref_loss_fn(p, batch):
        return torch.func.functional_call(model, p, (), {"input_ids": batch, "labels": batch}).loss

    sgd = lambda p, g: p - lr * g  # noqa: E731 - a functional update over the pytree
    history = []
    bar = tqdm(range(steps), desc=f"TP={mesh.size()}", disable=dist.get_rank() != 0)
    for _ in bar:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        ref_grads, ref_loss = torch.func.grad_and_value(ref_loss_fn)(ref_params, batch)
        params = optree.tree_map(sgd, params, grads)
        ref_params = optree.tree_map(sgd, ref_params, ref_grads)
        history.append((loss.item(), ref_loss.item()))
        bar.set_postfix(loss=f"{loss.item():.4f}", diff=f"{abs(loss.item() - ref_loss.item()):.2e}")
    full = unshard(params, shard_info)
    max_param_diff = max((full[k] - ref_params[k]).abs().max().item() for k in full)
    if dist.get_rank() == 0:
        print(f"\n{'step':>4}  {'sharded loss':>12}  {'unsharded':>12}  {'|diff|':>9}")
        for i, (a, b) in enumerate(history):
            print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}")
        worst = max(abs(a - b) for a, b in history)
        print(f"max |loss diff| {worst:.2e}; max |param diff| after training {max_param_diff:.2e}")
    return history
