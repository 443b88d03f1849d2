"""GRPO-style RL post-training of a tiny HF Llama with hp_functional, under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/grpo.py      # dp 2 x tp 2 on CPU/gloo

Two layouts of one model over the same four ranks: the *training* layout, FSDP x TP (``hpf.shard``
with HF's TP plan on ``tp``, then ``hpf.fsdp`` over ``dp``), and the *sampling* layout, TP with the
parameters replicated over ``dp`` (the ``shard()`` result before ``fsdp``), so that each dp replica
samples its own prompts.  One iteration:

1. ``hpf.reshard`` moves the training parameters to the sampling layout (in memory: one all-to-all
   per bucket, no rank ever holding the whole model);
2. each dp replica samples a group of ``G`` completions per prompt with ``hpf.generate``, inside
   ``hpf.rng`` folded by (iteration, replica), so the tokens do not depend on the layout;
3. a rule-based reward (the share of completion tokens in the lower half of the vocabulary),
   advantages normalised within each group;
4. one policy-gradient step (GRPO's clipped surrogate, one update per sample, no KL term) with
   ``torch.func.grad`` of the FSDP x TP ``apply_fn`` and ``hpf.optim.adamw``; gradients are the
   mean over the dp replicas.

Every rank also runs the same loop on the unsharded model (``model.generate`` under the same
``hpf.rng`` streams, ``.backward()``, ``torch.optim.AdamW``) and the script exits non-zero if the
sampled tokens differ or the parameters drift apart.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import hp_functional as hpf
from hp_functional.tools.models import build_model, tiny_config

SEED, LR, CLIP = 7, 2e-2, 0.2


def rewards(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The rule: the share of each completion's tokens below ``vocab // 2``."""
    return (completions < vocab // 2).float().mean(-1)


def advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    """Each reward against its group's (one prompt's ``group`` samples) mean, over their std."""
    r = reward.view(-1, group)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).reshape(-1)


def policy_loss(logits: torch.Tensor, seqs: torch.Tensor, start: int, adv: torch.Tensor) -> torch.Tensor:
    """GRPO's clipped surrogate on the completion tokens (positions ``start`` on) of ``seqs``,
    sampled by the current policy (the ratio is 1, its gradient the policy gradient)."""
    logp = F.log_softmax(logits[:, start - 1:-1].float(), -1).gather(-1, seqs[:, start:, None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.minimum(ratio * adv[:, None], ratio.clamp(1 - CLIP, 1 + CLIP) * adv[:, None])
    return -surrogate.mean()


def sample(generate, prompts: torch.Tensor, group: int, new_tokens: int, stream: int) -> torch.Tensor:
    """``group`` sampled completions per prompt (prompt and completion), drawn from stream ``stream``."""
    ids = prompts.repeat_interleave(group, 0)
    with hpf.rng(SEED).fold_in(stream):
        return generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens)


def train(mesh, iterations: int = 3, prompts: int = 2, group: int = 4, new_tokens: int = 6) -> dict:
    """``iterations`` GRPO iterations on ``mesh`` (``("dp", "tp")``) beside the unsharded model's;
    returns whether every sampled token agreed, the largest parameter difference and the mean rewards."""
    dp, r = mesh["dp"].size(), mesh["dp"].get_local_rank()
    model = build_model(tiny_config("llama"), seed=0).eval()  # the same weights on every rank
    vocab = model.config.vocab_size
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_hf(model), mesh)  # sampling: TP, dp replicas
    f_apply, f_params, f_info = hpf.fsdp(apply_fn, params, info, mesh, "dp")         # training: FSDP x TP
    f_params = {k: v.detach() for k, v in f_params.items()}
    opt = hpf.optim.adamw(LR, weight_decay=0.0)
    state = opt.init(f_params)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = torch.randint(3, vocab, (iterations, dp, prompts, 4), generator=torch.Generator().manual_seed(1))
    same, mean_rewards = True, []
    for it in range(iterations):
        s_params = hpf.reshard(f_params, f_info, info)  # the training layout's values at the sampling layout
        seqs = sample(functools.partial(hpf.generate, apply_fn, s_params), data[it, r], group, new_tokens, it * dp + r)
        adv = advantages(rewards(seqs[:, 4:], vocab), group)

        def loss_fn(p, seqs=seqs, adv=adv):
            return policy_loss(f_apply(p, input_ids=seqs, use_cache=False).logits, seqs, 4, adv)

        f_params, state = opt.update(torch.func.grad(loss_fn)(f_params), state, f_params)
        same &= _reference_step(model, ref_opt, data[it], seqs, r, it, group, new_tokens, vocab, mean_rewards)
    full = hpf.unshard(f_params, f_info)
    drift = max((full[k] - p.detach()).abs().max().item() for k, p in model.named_parameters())
    return {"tokens_equal": same, "param_diff": drift, "mean_reward": mean_rewards}


def _reference_step(model, opt, prompts, seqs, r: int, it: int, group: int, new_tokens: int, vocab: int,
                    mean_rewards: list) -> bool:
    """One iteration on the unsharded model, every replica's prompts in turn (the same streams); whether
    this rank's replica sampled the tokens the sharded run did."""
    model.eval()
    batches = [sample(model.generate, prompts[i], group, new_tokens, it * len(prompts) + i) for i in range(len(prompts))]
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for b in batches:
        loss = loss + policy_loss(model(input_ids=b, use_cache=False).logits, b, 4, advantages(rewards(b[:, 4:], vocab),
                                                                                               group))
    (loss / len(batches)).backward()
    opt.step()
    mean_rewards.append(torch.stack([rewards(b[:, 4:], vocab) for b in batches]).mean().item())
    return torch.equal(batches[r], seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, int(os.environ.get("WORLD_SIZE", "4")) // 2), mesh_dim_names=("dp", "tp"))
    out = train(mesh, args.iterations)
    ok = out["tokens_equal"] and out["param_diff"] < 1e-3
    if dist.get_rank() == 0:
        print(f"grpo dp 2 x tp {mesh['tp'].size()}: mean reward by iteration {[round(x, 3) for x in out['mean_reward']]}, "
              f"sampled tokens equal the unsharded run's: {out['tokens_equal']}, max |param diff| {out['param_diff']:.1e}")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
