"""``train.pipeline_fn.gpipe``: 2 stages of a tiny HF Llama (pp 2), 2 micro-batches, the loss and
every stage's gradients under ``torch.func.grad_and_value`` and ``.backward()`` equal the unstaged
model's on the whole batch; a batch the micro-batches do not divide is refused on every rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import hp_functional as hpf
from hp_functional.core.errors import PlanError
from hp_functional.core.host_comm import all_gather_objects
from hp_functional.train.pipeline_fn import gpipe
from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, raised

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=8, vocab_size=64)


def _loss(logits, target):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def case_gpipe(state):
    model = build_hf("llama", state, **CFG)
    m = mesh((2, 1), ("pp", "tp"))
    stage = hpf.pipeline_split(model, 2)[m.get_local_rank("pp")]
    apply_fn, params, _ = hpf.shard_stage(model, stage, {}, m)
    step = gpipe(apply_fn, stage, m, _loss, 2, hidden_size=CFG["hidden_size"])
    ids = torch.randint(0, CFG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(0))
    full = {k: v.detach() for k, v in model.named_parameters()}
    ref_grads, ref_loss = grad_and_value(lambda p: _loss(functional_call(model, p, (ids,)).logits, ids))(full)

    grads, loss = grad_and_value(step)(params, ids, ids)  # every stage: its own gradients
    p2 = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss2 = step(p2, ids, ids)
    loss2.backward()
    for name, g in (("func", grads), ("backward", {k: v.grad for k, v in p2.items()})):
        every = {k: v for part in all_gather_objects({k: v.detach() for k, v in g.items()}, m.get_group("pp"))
                 for k, v in part.items()}
        assert every.keys() == ref_grads.keys(), f"{name}: {sorted(set(ref_grads) ^ set(every))}"
        for k in ref_grads:
            assert_close(every[k], ref_grads[k], f"{name} {k}", atol=2e-5)
    if stage.is_last:
        assert_close(loss.detach(), ref_loss, "loss")
        assert_close(loss2.detach(), ref_loss, "loss (.backward())")
    else:
        assert float(loss) == 0.0
    bad = raised(step, params, ids[:3], ids[:3])  # 3 rows in 2 micro-batches
    dist.barrier()
    return bad


@pytest.mark.slow
def test_gpipe_equals_the_unstaged_model():
    results = get_pool(2).run(case_gpipe, make_hf_state("llama", **CFG))
    for bad in results:
        assert bad is not None and bad[0] == PlanError.__name__, bad


@pytest.mark.parametrize("mb", [0, 1.5])
def test_microbatches_must_be_a_positive_int(mb):
    with pytest.raises(PlanError, match="microbatches must be a positive int"):
        gpipe(None, None, None, _loss, mb, hidden_size=4)
