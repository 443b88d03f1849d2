"""Torch's own ParallelStyle plans (the dict ``parallelize_module`` takes) accepted as they are:
torchtitan's Llama SP plan and a plain Megatron plan on a tiny HF Llama — loss, logits and every
gradient vs the unsharded model; the same placements as our own plan; torchtitan's ``apply_tp``
plan (gathered head and loss parallel) on a torchtitan-style Llama (``tests/support/titan_llama.py``) vs
the unsharded model and torch's ``parallelize_module``; bad styles raise."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.func import grad_and_value

import hp_functional as hpf
from tests.support.helpers import assert_close, mesh, world
from tests.support.models import build_llama, make_llama_state

L = "model.layers.*"


def torchtitan_plan(local: bool = True) -> dict:
    """torchtitan's ``apply_tp`` plan (models/llama3/infra/parallelize.py) in HF Llama's names.
    Adapted: HF computes position ids and the causal mask from the embedding output's shape, so
    the embedding leaves replicated and the sequence is split at ``model.layers.0``'s input
    (torchtitan: ``output_layouts=Shard(1)`` on the embedding); HF calls ``self_attn`` with
    ``hidden_states=`` as a keyword and ``mlp`` positionally.  ``local=False`` flips every
    ``use_local_output`` (DTensor outputs in torch)."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), use_local_output=local),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=local),
        f"{L}.input_layernorm": SequenceParallel(use_local_output=not local),
        f"{L}.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                             desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                             use_local_output=local),
        f"{L}.self_attn.q_proj": ColwiseParallel(use_local_output=local),
        f"{L}.self_attn.k_proj": ColwiseParallel(use_local_output=local),
        f"{L}.self_attn.v_proj": ColwiseParallel(use_local_output=local),
        f"{L}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
        f"{L}.post_attention_layernorm": SequenceParallel(use_local_output=not local),
        f"{L}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=local),
        f"{L}.mlp.gate_proj": ColwiseParallel(use_local_output=local),
        f"{L}.mlp.up_proj": ColwiseParallel(use_local_output=local),
        f"{L}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
        "model.norm": SequenceParallel(use_local_output=not local),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=local),
    }


def megatron_plan() -> dict:
    """Plain Megatron TP: q/k/v/gate/up column-parallel, o/down row-parallel."""
    return {
        **{f"{L}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        f"{L}.self_attn.o_proj": RowwiseParallel(),
        f"{L}.mlp.gate_proj": ColwiseParallel(),
        f"{L}.mlp.up_proj": ColwiseParallel(),
        f"{L}.mlp.down_proj": RowwiseParallel(),
    }


def megatron_exit_plan() -> dict:
    """Megatron's f/g with the reduction where each block leaves (PrepareModuleInputOutput /
    PrepareModuleOutput over Partial outputs), the embedding dim-sharded (ColwiseParallel on an
    nn.Embedding) and a gathered output head."""
    return {
        **megatron_plan(),
        "model.embed_tokens": ColwiseParallel(output_layouts=Replicate()),
        f"{L}.self_attn": PrepareModuleInputOutput(
            input_kwarg_layouts={"hidden_states": Replicate()}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            output_layouts=(Partial(), None), desired_output_layouts=(Replicate(), None)),
        f"{L}.self_attn.o_proj": RowwiseParallel(output_layouts=Partial()),
        f"{L}.mlp": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
        f"{L}.mlp.down_proj": RowwiseParallel(output_layouts=Partial()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def _check(model, plan, m, ids, ref, ref_grads):
    """Loss, logits and every gradient of ``shard(model, plan)`` vs the unsharded run; max diffs."""
    apply_fn, params, info = hpf.shard(model, plan, m)
    out = apply_fn(params, input_ids=ids, labels=ids)
    diffs = {"logits": assert_close(out.logits, ref.logits.detach(), "logits"),
             "loss": assert_close(out.loss, ref.loss.detach(), "loss")}
    out.loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    assert set(full) == set(ref_grads), "every parameter has a gradient"
    diffs["grad"] = max(assert_close(full[k], ref_grads[k], f"grad {k}") for k in ref_grads)
    return {k: str(i.placements) for k, i in info.items()}, diffs


def case_torch_plan(state, kind: str):
    m = mesh()
    model = build_llama(state)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    out = {}
    if kind == "torchtitan":
        plan = hpf.ShardingPlan.from_torch(torchtitan_plan())
        out["placements"], out["diffs"] = _check(model, plan, m, ids, ref, ref_grads)
        # use_local_output=False (DTensor outputs in torch): the same conversion, the same values
        flipped = hpf.ShardingPlan.from_torch(torchtitan_plan(local=False))
        assert flipped.entries == plan.entries
        out["placements_nonlocal"], out["diffs_nonlocal"] = _check(model, flipped, m, ids, ref, ref_grads)
        # our hand-written equivalent: the same placement for every parameter
        _, _, info = hpf.shard(model, hpf.llama_sp_plan(), m)
        out["placements_ours"] = {k: str(i.placements) for k, i in info.items()}
    else:  # the dict passed straight to shard()
        out["placements"], out["diffs"] = _check(model, {"megatron": megatron_plan, "megatron_exit": megatron_exit_plan}[kind](),
                                                 m, ids, ref, ref_grads)
    return out


@pytest.mark.slow
def test_torchtitan_llama_plan_matches_unsharded_and_llama_sp_plan(pool):
    out = pool.run(case_torch_plan, make_llama_state(), "torchtitan")
    for r in out:
        assert r["placements"] == r["placements_ours"] == r["placements_nonlocal"]
    p = out[0]["placements"]
    assert p["model.embed_tokens.weight"] == "(Shard(dim=0),)" and p["lm_head.weight"] == "(Shard(dim=0),)"
    assert p["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
    assert p["model.norm.weight"] == "(Replicate(),)"
    print(f"world {pool.world}: max diffs {[(r['diffs'], r['diffs_nonlocal']) for r in out][0]}")


@pytest.mark.parametrize("kind", ["megatron", "megatron_exit"])
def test_megatron_torch_plan_straight_to_shard(pool, kind):
    out = pool.run(case_torch_plan, make_llama_state(), kind)
    p = out[0]["placements"]
    assert p["model.layers.1.self_attn.q_proj.weight"] == "(Shard(dim=0),)"
    assert p["model.layers.1.mlp.down_proj.weight"] == "(Shard(dim=1),)"
    embed = "(Shard(dim=1),)" if kind == "megatron_exit" else "(Replicate(),)"  # ColwiseParallel on an Embedding
    assert p["model.embed_tokens.weight"] == embed
    print(f"world {pool.world} {kind}: max diffs {out[0]['diffs']}")


class Unknown(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh):
        return module

    def __repr__(self) -> str:  # no object address: the message is the same on every rank
        return "Unknown()"


class SubColwise(ColwiseParallel):  # may change what _apply does: not taken for a ColwiseParallel
    pass


# (pattern, torch style, words the message must hold) — raised when the plan is built
BAD_STYLES = [
    ("lm_head", ColwiseParallel(output_layouts=Partial()), ["'lm_head'", "ColwiseParallel", "output_layouts=Partial(sum)"]),
    (f"{L}.mlp.down_proj", RowwiseParallel(output_layouts=Partial("avg")), ["'model.layers.*.mlp.down_proj'", "Partial(avg)"]),
    (f"{L}.mlp", PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Partial()),
     ["'model.layers.*.mlp'", "PrepareModuleInput", "no redistribution"]),
    ("model.norm", Unknown(), ["'model.norm'", "torch style Unknown has no counterpart"]),
    ("lm_head", SubColwise(), ["'lm_head'", "torch style SubColwise has no counterpart"]),
]


def case_bad_styles(state):
    model, m = build_llama(state), mesh()
    messages = []
    for pattern, style, words in BAD_STYLES:
        for build in (lambda: hpf.ShardingPlan.from_torch({pattern: style}),
                      lambda: hpf.shard(model, {pattern: style}, m)):
            with pytest.raises(hpf.PlanError) as exc:
                build()
            assert all(w in str(exc.value) for w in words), (words, str(exc.value))
        messages.append(str(exc.value))
    # a style on a module kind it does not support: raised by shard() naming the module and the entry
    for style, words in ((ColwiseParallel(), ["model.norm", "'model.norm'", "ColwiseParallel needs an nn.Linear"]),
                         (RowwiseParallel(), ["model.embed_tokens", "input_layouts=Replicate()"])):
        target = "model.norm" if isinstance(style, ColwiseParallel) else "model.embed_tokens"
        with pytest.raises(hpf.PlanError) as exc:
            hpf.shard(model, {target: style}, m)
        assert all(w in str(exc.value) for w in words), (words, str(exc.value))
        messages.append(str(exc.value))
    return messages


def test_bad_torch_styles_raise_on_every_rank(pool):
    out = pool.run(case_bad_styles, make_llama_state())
    assert all(r == out[0] for r in out)  # the same message on every rank
    print("\n".join(out[0]))


# ---------------------------------------------------------------- torchtitan's own model and plan
def case_titan(state, loss_parallel: bool):
    """torchtitan's ``apply_tp`` plan on a torchtitan-style Llama, through ``from_torch`` and through
    torch's own ``parallelize_module`` (DTensor): logits, loss, every gradient and every placement
    vs the unsharded model and vs torch.  ``loss_parallel``: torchtitan's vocab-sharded head, the
    loss taken by ``hpf.vocab_parallel_cross_entropy`` here and under torch's ``loss_parallel()``
    context there (as torchtitan's train step does)."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel, parallelize_module

    from tests.support.helpers import rank
    from tests.support.titan_llama import VOCAB, Transformer, titan_tp_plan

    m, model = mesh(), Transformer()
    model.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))

    def loss_of(logits):
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    ref_logits = model(ids)
    ref_loss = loss_of(ref_logits)
    ref_loss.backward()

    plan = titan_tp_plan(loss_parallel)
    apply_fn, params, info = hpf.shard(model, hpf.ShardingPlan.from_torch(plan), m)  # the one changed line
    logits = apply_fn(params, ids)
    if loss_parallel:  # this rank's slice of the vocabulary, never gathered
        v = VOCAB // world()
        assert logits.shape == (2, 8, v), logits.shape
        ref_logits = ref_logits[..., rank() * v:(rank() + 1) * v]
        loss = hpf.vocab_parallel_cross_entropy(logits.flatten(0, 1), ids.flatten(), m, "tp")
    else:
        loss = loss_of(logits)
    loss.backward()
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    assert set(full) == {k for k, _ in model.named_parameters()}, "every parameter has a gradient"

    theirs = parallelize_module(copy.deepcopy(model), m, plan)
    t_logits = theirs(ids)
    if loss_parallel:
        assert isinstance(t_logits, DTensor) and t_logits.placements == (Shard(2),), t_logits
        with torch_loss_parallel():
            t_loss = loss_of(t_logits)
            t_loss.backward()
        t_logits, t_loss = t_logits.to_local(), t_loss.full_tensor()
    else:
        t_logits = t_logits.full_tensor() if isinstance(t_logits, DTensor) else t_logits
        t_loss = loss_of(t_logits)
        t_loss.backward()
    diffs = {"logits vs unsharded": assert_close(logits, ref_logits.detach(), "logits"),
             "logits vs parallelize_module": assert_close(logits, t_logits.detach(), "logits vs torch"),
             "loss vs unsharded": assert_close(loss, ref_loss.detach(), "loss"),
             "loss vs parallelize_module": assert_close(loss, t_loss.detach(), "loss vs torch"),
             "grad vs unsharded": max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters()),
             "grad vs parallelize_module": max(assert_close(full[k], p.grad.full_tensor(), f"torch grad {k}")
                                               for k, p in theirs.named_parameters())}
    placements = {k: (tuple(info[k].placements), tuple(p.placements)) for k, p in theirs.named_parameters()}
    assert all(a == b for a, b in placements.values()), placements
    return diffs, {k: str(a) for k, (a, _) in placements.items()}


@pytest.mark.parametrize("loss_parallel", [False, True], ids=["gathered_head", "loss_parallel"])
@pytest.mark.slow
def test_torchtitan_model_and_plan_match_unsharded_and_parallelize_module(pool, loss_parallel):
    from tests.support.titan_llama import make_titan_state

    out = pool.run(case_titan, make_titan_state(), loss_parallel)
    p = out[0][1]
    assert p["tok_embeddings.weight"] == "(Shard(dim=0),)" and p["output.weight"] == "(Shard(dim=0),)"
    assert p["layers.1.attention.wo.weight"] == p["layers.1.feed_forward.w2.weight"] == "(Shard(dim=1),)"
    assert p["layers.1.attention_norm.weight"] == p["norm.weight"] == "(Replicate(),)"
    print(f"world {pool.world} loss_parallel={loss_parallel}: max diffs {[r[0] for r in out]}")


def case_no_parallel_beside_torch_styles(state):
    """Our ``NoParallel`` sits in the same dict as torch's styles (torchtitan uses its own
    NoParallel for MoE routers): the module stays replicated, the rest is as torch's plan says."""
    model = build_llama(state)
    plan = {**megatron_plan(), "model.layers.*.mlp.gate_proj": hpf.NoParallel(), "model.layers.*.mlp.up_proj": hpf.NoParallel(),
            "model.layers.*.mlp.down_proj": hpf.NoParallel()}
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    assert info["model.layers.0.mlp.gate_proj.weight"].placements == (Replicate(),)
    assert info["model.layers.0.self_attn.q_proj.weight"].placements == (Shard(0),)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    return assert_close(apply_fn(params, input_ids=ids).logits, model(input_ids=ids).logits.detach(), "logits")


def test_no_parallel_entries_beside_torch_styles(pool):
    pool.run(case_no_parallel_beside_torch_styles, make_llama_state())


def case_loss_parallel(state):
    """torchtitan's loss-parallel head (``ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)``) with ``from_torch(..., loss_parallel=True)``: the loss over
    vocab-sharded logits and every gradient match the unsharded model."""
    model = build_llama(state)
    plan = hpf.ShardingPlan.from_torch({**megatron_plan(), "lm_head": ColwiseParallel(
        output_layouts=Shard(-1), use_local_output=False)}, loss_parallel=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    apply_fn, params, info = hpf.shard(model, plan, mesh())
    out = apply_fn(params, input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape[-1] == model.config.vocab_size // world(), "logits stay vocab-sharded"
    full = hpf.unshard({k: p.grad for k, p in params.items()}, info)
    return (assert_close(out.loss, ref.loss.detach(), "loss"),
            max(assert_close(full[k], p.grad, f"grad {k}") for k, p in model.named_parameters()))


def test_loss_parallel_head_from_torch(pool):
    print(pool.run(case_loss_parallel, make_llama_state())[0])


# ---------------------------------------------------------------- head counts under PrepareModuleInput
class HeadCountAttention(nn.Module):
    """Attention that reshapes by its head-count attribute, as DeepSeek MLA's
    ``k_pe.expand(-1, -1, self.n_heads, -1)``: a shared per-position key part broadcast to every head."""

    def __init__(self, dim: int = 16, n_heads: int = 4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.wk_pe = nn.Linear(dim, self.head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        k = k + self.wk_pe(x)[:, None].expand(-1, self.n_heads, -1, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class HeadCountNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(32, 16), HeadCountAttention(), nn.Linear(16, 32)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.attn(x)).square().mean()


def test_prepare_module_input_localises_the_head_counts():
    """torch's ``PrepareModuleInput`` over an attention that reshapes by ``self.n_heads``: under torch
    the module sees global DTensors, here local shards, so ``from_torch`` divides the head counts
    (``n_heads``, not ``head_dim``) in the skeleton; loss and every gradient at tp 2 equal the
    unsharded model's, and the user's module keeps its own count."""
    torch.manual_seed(0)
    model = HeadCountNet()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = model(ids)
    ref.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    plan = hpf.ShardingPlan.from_torch({
        "attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        **{f"attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}, "attn.wo": RowwiseParallel()})

    def rank(m):
        apply_fn, params, info = hpf.shard(model, plan, m, verify=False)
        grads, loss = grad_and_value(lambda p: apply_fn(p, ids))(params)
        return loss, hpf.unshard(grads, info)

    for loss, grads in hpf.emulate(rank, (2,), ("tp",)):
        assert_close(loss, ref.detach(), "loss")
        for k, g in ref_grads.items():
            assert_close(grads[k], g, f"grad {k}")
    assert model.attn.n_heads == 4
