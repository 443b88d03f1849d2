"""``export_hf`` round trips of the parameters whose full tensor is more than one slice per rank:
packed (Phi-3's fused ``gate_up_proj`` under ``packed_colwise``, the plan of ``test_weights.py``), tied
(Llama's embeddings and head; XLM-RoBERTa's, whose first name is the tied copy, so the group is
renamed to the name HF stores) and stacked experts (Mixtral's ``gate_up_proj``/``down_proj`` at ep 2).

Each: shard at tp 2 or ep 2 -> one training step (``torch.func.grad``) -> ``export_hf`` -> load
back with HF's ``from_pretrained`` and with ``hpf.from_pretrained`` at another layout, and compare
every tensor with the unsharded model after the same step (fp32, 1e-5; a row out of place is
off by the weights' scale).  For the dense models the exported files also hold exactly the
tensor names that ``save_pretrained`` of that reference writes (the tied group under HF's name)."""

from __future__ import annotations

import glob

import pytest
import torch

from tests.conftest import get_pool
from tests.support.helpers import assert_close, build_hf, make_hf_state, mesh, rank

LR = 0.5


def _ids(vocab: int = 128):
    return torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(1))


def _files(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(f"{folder}/*.safetensors")):
        out |= load_file(f)
    return out


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> float:
    assert set(actual) == set(expected), (what, sorted(set(actual) ^ set(expected))[:6])
    return max(assert_close(actual[k], expected[k], f"{what}: {k}") for k in expected)


def _model(kind: str):
    """(the reference model, its plan at layout A, the mesh of A, the plan to load it back at
    layout B, whether save_pretrained writes the same tensor names)."""
    import hp_functional as hpf

    if kind == "packed":
        from tests.runtime.test_weights import _plan

        model = build_hf("phi3", make_hf_state("phi3"))  # gate_up_proj packed_colwise, a vocab-parallel embedding
        return model, _plan("phi3", model), mesh(), None, True  # back at HF's plan: plain colwise, no blocks
    if kind == "tied":
        model = build_hf("llama", make_hf_state("llama", tie_word_embeddings=True), tie_word_embeddings=True)
        return model, None, mesh(), hpf.ShardingPlan({}), True
    if kind == "tied_copy_first":
        from transformers import AutoModelForCausalLM

        from hp_functional.tools.model_configs import tiny_config_for

        config = tiny_config_for("xlm-roberta", tie_word_embeddings=True, is_decoder=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        layer = "roberta.encoder.layer.*"
        plan = hpf.ShardingPlan({f"{layer}.intermediate.dense": hpf.Colwise(gather_output=True)})
        return model, plan, mesh(), hpf.ShardingPlan({}), True
    from tests.parallel.test_experts import build_moe, make_moe_state

    model = build_moe("mixtral", make_moe_state("mixtral"))  # ep 2 -> back at HF's tp plan (experts packed colwise)
    return model, hpf.ShardingPlan.from_hf(model, ep_axis="ep"), mesh((2,), ("ep",)), None, False


def case_export_round_trip(kind: str, out: str) -> dict:
    """Every rank: shard, step, export, the load at layout B; then rank 0: the files and HF's load."""
    from transformers import AutoModelForCausalLM

    import hp_functional as hpf

    model, plan, m, plan_back, same_names = _model(kind)
    ids = _ids(model.config.vocab_size)
    # verify=False: shard()'s probe (tested elsewhere) would double the case's cost
    apply_fn, params, info = hpf.shard(model, plan if plan is not None else hpf.ShardingPlan.from_hf(model), m,
                                       verify=False)
    kinds = {"packed": any(i.blocks for i in info.values()), "tied": any(i.aliases for i in info.values()),
             "experts": any("experts" in k and i.is_sharded for k, i in info.items())}
    grads = torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids).loss)(params)
    trained = {k: p - LR * grads[k] for k, p in params.items()}
    model(input_ids=ids, labels=ids).loss.backward()  # the unsharded reference takes the same step
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        model.zero_grad(set_to_none=True)
    expected = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    hpf.export_hf(trained, info, model, out, max_shard_size="30KB")
    diffs = {"kinds": kinds}
    _, params_b, info_b, _ = hpf.from_pretrained(out, plan_back, mesh(), verify=False)
    full = hpf.unshard(params_b, info_b)
    aliases = {a: full[k] for k, i in info_b.items() for a in i.aliases}
    diffs["hpf.from_pretrained at another layout"] = _same(full | aliases, expected, "hpf.from_pretrained of the export")
    diffs["layouts differ"] = sum((info[k].placements, info[k].blocks) != (info_b[k].placements, info_b[k].blocks)
                                  for k in info if k in info_b)
    if rank() == 0:  # after the last collective, so that a failure here leaves no rank waiting
        if same_names:  # the names and tensors save_pretrained writes (a tied group once, under HF's name)
            ref_dir = f"{out}-save_pretrained"
            model.save_pretrained(ref_dir)
            diffs["files"] = _same(_files(out), _files(ref_dir), "exported file vs save_pretrained")
        back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        diffs["HF from_pretrained"] = _same({n: p.detach() for n, p in back.named_parameters(remove_duplicate=False)},
                                            expected, "HF from_pretrained of the export")
    return diffs


@pytest.mark.parametrize("kind", ["packed", "tied", "tied_copy_first", "experts"])
@pytest.mark.slow  # 0.6 to 0.7 s a case: two loads and a save_pretrained
def test_export_hf_round_trips_packed_tied_and_expert_parameters(kind, tmp_path):
    results = get_pool(2).run(case_export_round_trip, kind, str(tmp_path / "export"))
    print(kind, results[0])
    kinds = results[0]["kinds"]
    assert kinds["packed" if kind == "packed" else "tied" if kind.startswith("tied") else "experts"], kinds
    assert all(r["layouts differ"] > 0 for r in results), "layout B must differ from layout A"


def test_export_hf_dtype_casts_every_floating_tensor_and_nothing_else(tmp_path):
    """``export_hf(dtype=torch.bfloat16)`` writes what ``model.to(torch.bfloat16).state_dict()`` holds:
    every floating tensor cast (matrices, biases, norm weights, floating buffers such as BatchNorm's
    running statistics), integer buffers (``num_batches_tracked``) as they are; TP-sharded at tp 2."""
    import copy

    import hp_functional as hpf
    from tests.support.models import BufferNet

    torch.manual_seed(0)
    model = BufferNet()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.num_batches_tracked.fill_(7)
    expected = copy.deepcopy(model).to(torch.bfloat16).state_dict()
    assert {t.dtype for t in expected.values()} == {torch.bfloat16, torch.int64}
    out = tmp_path / "export"

    def rank(m):
        _, params, info = hpf.shard(model, {"up": hpf.Colwise(), "down": hpf.Rowwise()}, m, verify=False)
        hpf.export_hf(params, info, model, out, dtype=torch.bfloat16)

    hpf.emulate(rank, (2,), ("tp",))
    files = _files(str(out))
    assert set(files) == set(expected), sorted(set(files) ^ set(expected))
    for k, t in expected.items():
        assert files[k].dtype == t.dtype and torch.equal(files[k], t), (k, files[k].dtype, t.dtype)
