"""The seeded mutations of ``make mutation-check`` (``tests/mutation_check.py``): each one a bug the
suite must catch, written as a small patch to one named function, with the guarantee it breaks and
the tests that cover it.  A new guarantee comes with its mutation here (docs/testing.md).

``core=True`` marks a core invariant (collective transposes and batching rules, FSDP's scaling,
the recompute's RNG, the shard-time proof, checksums): its tests run with ``-m "not slow"``, so
``make test-fast`` must kill it too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTATIONS", "Mutation"]


@dataclass(frozen=True)
class Mutation:
    """Replace ``find`` with ``replace`` inside ``target`` (``path::Qualified.name``), then run ``tests``."""

    name: str
    target: str
    find: str
    replace: str
    tests: tuple[str, ...]
    guards: str
    core: bool = False

    @property
    def path(self) -> str:
        return self.target.split("::")[0]

    @property
    def function(self) -> str:
        return self.target.split("::")[1]


COLL = "hp_functional/core/collectives.py"
FAST_COLLECTIVES = ("tests/test_fast_invariants.py", "tests/core/test_collectives.py", "tests/core/test_higher_order.py")

MUTATIONS: tuple[Mutation, ...] = (
    # ------------------------------------------------------------ the collective table
    Mutation("copy-to-transpose-all-reduce", f"{COLL}::CopyTo",
             '"I→V", "reduce_from")', '"I→V", "all_reduce")', FAST_COLLECTIVES,
             "copy_to's transpose is reduce_from: the same first-order backward, but grad∘grad off by the world size",
             core=True),
    Mutation("reduce-from-transpose", f"{COLL}::ReduceFrom",
             '"V→I", "copy_to")', '"V→I", "leave_region")', FAST_COLLECTIVES,
             "reduce_from's transpose is copy_to (identity), not a keep-on-rank-0", core=True),
    Mutation("split-to-transpose", f"{COLL}::SplitTo",
             '"I→V", "gather_from")', '"I→V", "all_gather")', FAST_COLLECTIVES,
             "split_to's transpose is gather_from (V→I), whose own backward splits again", core=True),
    Mutation("reduce-scatter-transpose-scale", f"{COLL}::_collective",
             "conjugate = COLLECTIVES[transpose].apply(grad, *transpose_args(*ctx.args))",
             "conjugate = COLLECTIVES[transpose].apply(grad, *transpose_args(*ctx.args))\n"
             "        conjugate = conjugate * 0.5 if transpose == \"all_gather\" else conjugate",
             FAST_COLLECTIVES, "reduce_scatter's transpose is the plain all_gather (no scale)", core=True),
    Mutation("partial-from-keeps-everywhere", f"{COLL}::_keep_on_rank0",
             "if g.rank == 0", "if g.rank >= 0", FAST_COLLECTIVES,
             "partial_from keeps the value on rank 0 only (the others contribute zeros)", core=True),
    Mutation("batching-rule-dims-not-shifted", f"{COLL}::_shift_dims",
             "a + 1 if isinstance(a, int)", "a if isinstance(a, int)", FAST_COLLECTIVES,
             "a collective's batching rule moves its dims past the vmapped one", core=True),
    Mutation("batching-rule-batch-dim-last", f"{COLL}::_collective",
             "eager.apply(x.movedim(in_dims[0], 0), *batch_args(args)), 0",
             "eager.apply(x.movedim(in_dims[0], -1), *batch_args(args)), 0", FAST_COLLECTIVES,
             "a collective's vmap rule puts the vmapped dim in front before communicating", core=True),
    Mutation("jvp-rule-identity", f"{COLL}::_collective",
             "return eager.apply(tangent, *ctx.args)", "return tangent", FAST_COLLECTIVES,
             "a collective's jvp is the collective applied to the tangent", core=True),
    Mutation("all-to-all-transpose-dims", f"{COLL}::_swap_dims",
             "return concat_dim, split_dim, group", "return split_dim, concat_dim, group", FAST_COLLECTIVES,
             "all_to_all's transpose swaps its split and concat dims", core=True),
    Mutation("ppermute-transpose-inverse", f"{COLL}::_invert_perm",
             "return tuple((d, s) for s, d in perm), group", "return tuple(perm), group", FAST_COLLECTIVES,
             "ppermute's transpose sends every pair back", core=True),
    Mutation("all-to-all-v-transpose-splits", f"{COLL}::_swap_splits",
             "return dim, recv, send, group", "return dim, send, recv, group",
             ("tests/test_fast_invariants.py", "tests/core/test_collectives.py", "tests/parallel/test_experts.py"),
             "all_to_all_v's transpose swaps the send and receive splits", core=True),
    Mutation("bucketed-reduction-skipped", "hp_functional/core/buckets.py::_backward",
             "return (None, None, *_reduced(grads, ctx.buckets, ctx.groups))", "return (None, None, *grads)",
             ("tests/parallel/test_mlp.py", "tests/models/test_llama.py", "tests/compile/test_gradient_proof.py"),
             "a replicated parameter consumed by rank-varying compute gets its gradient summed (bucketed copy_to)",
             core=True),
    # ------------------------------------------------------------ FSDP: scaling and schedule
    Mutation("fsdp-gradient-not-averaged", "hp_functional/train/fsdp.py::_bucket",
             "divisor = math.prod(n for a, n in sizes.items() if a not in folded)", "divisor = 1",
             ("tests/test_fast_invariants.py", "tests/train/test_fsdp.py", "tests/train/test_clip_dp.py"),
             "fsdp's gradient is the mean over the dp ranks", core=True),
    Mutation("fsdp-folded-cp-divided", "hp_functional/train/fsdp.py::_bucket",
             "divisor = math.prod(n for a, n in sizes.items() if a not in folded)",
             "divisor = math.prod(sizes.values())",
             ("tests/test_fast_invariants.py", "tests/parallel/test_context_parallel_hf.py"),
             "a cp sum folded into fsdp's reduce-scatter is a sum, not a mean", core=True),
    Mutation("fsdp-mean-scatter-not-divided", f"{COLL}::_scatter_mean",
             "/ divisor).to(precision.dtype)", ").to(precision.dtype)",
             ("tests/test_fast_invariants.py", "tests/core/test_collectives.py"),
             "mean_scatter (fsdp's gradient reduce-scatter) divides by the dp size", core=True),
    Mutation("fsdp-gather-transpose-not-mean", f"{COLL}::_to_mean_scatter",
             "return dim, precision, divisor, group", "return dim, precision, 1, group",
             ("tests/test_fast_invariants.py", "tests/core/test_collectives.py", "tests/models/test_transform_matrix.py"),
             "gather_params' transpose is mean_scatter: the dp mean, in grad, jvp∘grad and grad∘grad alike", core=True),
    Mutation("fsdp-row-split-offset", "hp_functional/train/fsdp_bucket.py::Bucket.gather",
             "t = full[:, piece.start:piece.start + piece.size]",
             "t = full[:, piece.start:piece.start + piece.size].roll(1, 0)",
             ("tests/test_fast_invariants.py", "tests/train/test_fsdp.py"),
             "fsdp's gather puts every rank's rows of a leaf back in rank order", core=True),
    # ------------------------------------------------------------ CP and EP gradients
    Mutation("cp-loss-summed-twice", "hp_functional/parallel/context/styles.py::ContextParallelForward.loss",
             "return C.reduce_from(", "return C.all_reduce(", ("tests/parallel/test_context_parallel_hf.py",),
             "the CP loss leaves through reduce_from: each rank's share gets the full gradient once"),
    Mutation("ring-attention-dq-unscaled", "hp_functional/core/ring_attention.py::RingAttention._ring_backward",
             "dq = dq + (ds @ kb) * scale", "dq = dq + (ds @ kb)",
             ("tests/core/test_ring_attention.py",), "ring attention's backward (dq) equals SDPA's"),
    Mutation("ep-routing-weight-gradient-lost", "hp_functional/parallel/experts/styles.py::dispatch_combine",
             "weighted = (back * weight[:, None])", "weighted = (back * weight[:, None].detach())",
             ("tests/parallel/test_experts.py",), "the router's weights get their gradient through expert parallelism"),
    Mutation("ep-combine-not-differentiated", "hp_functional/parallel/experts/styles.py::dispatch_combine",
             "back = C.all_to_all_v(out, 0, recv, send, g)", "back = C.all_to_all_v(out.detach(), 0, recv, send, g)",
             ("tests/parallel/test_experts.py",), "the experts' weights get their gradient back through the combine"),
    # ------------------------------------------------------------ the proof and the agreements
    Mutation("probe-gradient-check-off", "hp_functional/runtime/probe.py::_compare",
             "if worst > TOLERANCE * 10:", "if worst > 1e30:",
             ("tests/compile/test_gradient_proof.py::test_probe_refuses_a_wrong_gradient",),
             "the shard-time probe refuses a plan that gives a parameter a wrong gradient", core=True),
    Mutation("probe-loss-check-off", "hp_functional/runtime/probe.py::_compare",
             "if not torch.allclose(loss.float(), ref.float(), rtol=TOLERANCE, atol=TOLERANCE):", "if False:",
             ("tests/compile/test_gradient_proof.py::test_probe_refuses_a_wrong_loss",),
             "the shard-time probe refuses a plan whose loss is not the model's", core=True),
    Mutation("agreement-ignores-values", "hp_functional/compile/agree.py::agree",
             "value_checksums(values) if values is not None else None", "None",
             ("tests/runtime/test_reliability.py::test_ranks_with_different_weights_raise_naming_the_first_tensor",
              "tests/runtime/test_reliability.py::test_one_replicated_tensor_differing_on_one_rank_is_named"),
             "ranks holding different weights raise PlanMismatchError at shard()", core=True),
    Mutation("checksum-not-position-sensitive", "hp_functional/compile/agree.py::checksum",
             "return f\"crc{zlib.crc32(memoryview(data.numpy()))}\"", "return f\"crc{int(data.sum())}\"",
             ("tests/test_fast_invariants.py::test_value_checksum_is_exact_and_position_sensitive",),
             "the value checksum is exact and position-sensitive (a permutation of the bytes differs)", core=True),
    Mutation("device-checksum-not-position-sensitive", "hp_functional/compile/agree.py::device_checksum",
             "return f\"sum{int(plain)}:{int(weighted)}\"", "return f\"sum{int(plain)}\"",
             ("tests/test_fast_invariants.py::test_value_checksum_is_exact_and_position_sensitive",),
             "the on-device checksum (accelerators) is position-sensitive too", core=True),
    Mutation("input-value-check-off", "hp_functional/runtime/inputs.py::_describe",
             "if values and x.device.type != \"meta\"", "if False",
             ("tests/runtime/test_run_agreement.py::test_inputs_that_differ_across_tp_ranks_raise_on_every_rank",),
             "with the value check on, inputs that differ in value across a replicating axis raise InputMismatchError"),
    Mutation("other-threads-not-refused", "hp_functional/runtime/apply_fn.py::make_apply_fn",
             "if guard is not None:\n                guard.refuse()", "if False:\n                guard.refuse()",
             ("tests/runtime/test_reentrant.py::test_multi_rank_refuses_a_single_other_thread",),
             "apply_fn on a multi-rank mesh refuses calls from another thread"),
    Mutation("apply-fn-shape-check-off", "hp_functional/runtime/apply_fn.py::make_apply_fn",
             "if tuple(v.shape for v in values) != shapes:", "if False:", ("tests/runtime/test_bad_input.py",),
             "apply_fn(model.state_dict()) is a PlanError before any collective"),
    Mutation("dataflow-misses-varying-uses", "hp_functional/compile/dataflow.py::_Taint.__torch_function__",
             "update(met & replicated)", "update(set())",
             ("tests/compile/test_gradient_proof.py", "tests/models/test_hf_families.py"),
             "a replicated parameter that rank-varying data reaches gets its gradient summed (or is refused)"),
    # ------------------------------------------------------------ checkpoints and weights
    Mutation("checkpoint-checksum-not-verified", "hp_functional/train/ckpt_integrity.py::VerifyingReader._read_chunk",
             "if len(data) != info.length or digest(data) != self._sums[chunk_key(index)]:",
             "if len(data) != info.length:", ("tests/train/test_checkpoint_security.py",),
             "a checkpoint whose bytes changed is refused on load", core=True),
    Mutation("checkpoint-reshard-offset", "hp_functional/train/dcp_planners.py::Boxed.__get_tensor_shard__",
             "return self._by_start[tuple(index.offset)].of_local(self.local)",
             "return self._by_start[tuple(index.offset)].of_local(self.local).flip(0)",
             ("tests/train/test_dcp.py",), "a checkpoint saved at one layout loads exactly at another"),
    Mutation("export-packed-off-by-one-row", "hp_functional/train/export.py::export_hf",
             "{_stored_name(k, shard_info[k], model): t for k, t in full.items()}",
             "{_stored_name(k, shard_info[k], model): (t.roll(1, 0) if shard_info[k].blocks else t) "
             "for k, t in full.items()}",
             ("tests/train/test_export_kinds.py", "tests/runtime/test_weights.py"),
             "export_hf writes a packed (fused) parameter exactly"),
    Mutation("export-tied-stored-under-own-name", "hp_functional/train/export.py::_stored_name",
             "return tied[key] if isinstance(tied, Mapping) and tied.get(key) in info.aliases else key", "return key",
             ("tests/train/test_export_kinds.py", "tests/runtime/test_weights.py"),
             "export_hf stores a tied group under the name HF loads it from"),
    Mutation("export-experts-permuted", "hp_functional/train/export.py::export_hf",
             "{_stored_name(k, shard_info[k], model): t for k, t in full.items()}",
             "{_stored_name(k, shard_info[k], model): (t.roll(1, 0) if \"experts\" in k else t) "
             "for k, t in full.items()}",
             ("tests/train/test_export_kinds.py", "tests/runtime/test_weights.py"),
             "export_hf writes stacked expert weights exactly"),
    Mutation("import-box-misplaced", "hp_functional/runtime/weights.py::read_local",
             "box.of_local(local).copy_(box.of_global(stored))",
             "box.of_local(local).copy_(box.of_global(stored).flip(0))",
             ("tests/runtime/test_weights.py",), "from_pretrained reads each rank's boxes of every tensor exactly"),
    Mutation("buffers-not-restored", "hp_functional/runtime/buffers.py::BufferSlots.restore",
             "for store, attr, value in reversed(saved):\n            store[attr] = value", "return",
             ("tests/runtime/test_buffers.py",), "after apply_fn(..., buffers=) the skeleton holds its own buffers again"),
    # ------------------------------------------------------------ transforms, randomness, per-example clipping
    Mutation("recompute-jvp-without-rng", "hp_functional/runtime/remat.py::Recompute.jvp",
             "with _replayed_rng(call.rng, call.block.device_type):", "with _replayed_rng(None, call.block.device_type):",
             ("tests/test_fast_invariants.py::test_checkpoint_recompute_replays_dropout_rng",),
             "the recompute's jvp replays the forward's RNG (dropout) like its backward"),
    Mutation("recompute-jvp-tangents-dropped", "hp_functional/runtime/remat.py::Recompute.jvp",
             "            out[k] = t\n", "            out[k] = torch.zeros_like(t)\n",
             ("tests/models/test_transform_matrix.py",), "jvp through an activation-recomputed block is exact"),
    Mutation("gaussian-like-index-offset", "hp_functional/core/counter_rng.py::global_index",
             "r = torch.arange(offset[d], offset[d] + local_shape[d]", "r = torch.arange(0, local_shape[d]",
             ("tests/runtime/test_rng.py",), "gaussian_like draws by global element index: the same gathered noise at any layout",
             core=True),
    Mutation("rng-dropout-chunk-offset", "hp_functional/runtime/rng_layout.py::layout_table",
             "dims = [(d, f, mesh.get_local_rank(axis) // (sizes[axis] // f))]", "dims = [(d, f, 0)]",
             ("tests/runtime/test_rng.py",), "hpf.rng's dropout inside sharded compute draws each rank's global indices",
             core=True),
    Mutation("rng-cp-positions-contiguous", "hp_functional/runtime/rng_layout.py::layout_table",
             "positions = cp_positions(root.rank, seq, root.size, root.layout)",
             'positions = cp_positions(root.rank, seq, root.size, "contiguous")',
             ("tests/runtime/test_rng.py",), "hpf.rng's dropout on a context-parallel sequence draws each zigzag chunk's "
             "global positions", core=True),
    Mutation("clip-per-example-not-clipped", "hp_functional/train/clip_per_example.py::_Plan.run",
             "coef = (max_norm / (norms_t + 1e-6)).clamp(max=1.0)", "coef = torch.ones_like(norms_t)",
             ("tests/train/test_clip_per_example.py",), "clip_per_example clips each example's whole-model norm to max_norm"),
    # ------------------------------------------------------------ recompute, training, optimizers
    Mutation("recompute-rng-not-replayed", "hp_functional/runtime/remat.py::_replayed_rng",
             "torch.set_rng_state(cpu)", "pass", ("tests/test_fast_invariants.py", "tests/runtime/test_remat.py"),
             "a recomputed block draws the forward's dropout masks", core=True),
    Mutation("reduce-gradients-sums", "hp_functional/train/data_parallel.py::reduce_gradients",
             "total = total / group.size", "total = total", ("tests/train/test_clip_dp.py",),
             "reduce_gradients(op='mean') averages over the dp ranks"),
    Mutation("clip-counts-replicas", "hp_functional/train/clip.py::_owns",
             "return all(owns(p, c) for c, p in zip(coord, info.placements, strict=True))", "return True",
             ("tests/train/test_clip_dp.py",), "clip_grad_norm counts each replicated leaf once"),
    Mutation("adamw-no-bias-correction", "hp_functional/train/optim.py::adamw",
             "step_size = lr_k / bias_correction1", "step_size = lr_k", ("tests/train/test_optim.py",),
             "adamw equals torch.optim.AdamW"),
    Mutation("adamw-decays-every-leaf", "hp_functional/train/optim.py::adamw",
             "idx = [i for i, n in enumerate(keys) if decays(n)]", "idx = list(range(len(keys)))",
             ("tests/train/test_optim.py",), "adamw's mask leaves the excluded leaves undecayed"),
    Mutation("sgd-nesterov-ignored", "hp_functional/train/optim.py::sgd",
             "g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf", "g = buf",
             ("tests/train/test_optim.py",), "sgd(nesterov=True) equals torch.optim.SGD"),
    Mutation("vocab-loss-bad-label-silent", "hp_functional/parallel/tensor/vocab.py::vocab_parallel_cross_entropy",
             "loss = torch.where((owners != 1) & (labels != ignore_index), torch.nan, loss)", "pass",
             ("tests/parallel/test_loss_parallel.py",), "a label no rank owns gives a NaN loss, never a silent logsumexp"),
    Mutation("ulysses-position-order-ignored", "hp_functional/parallel/ulysses/attention.py::ulysses_attention",
             'ordered = layout != "contiguous"', "ordered = False",
             ("tests/parallel/test_ulysses.py::test_kernel_matches_sdpa",),
             "Ulysses attends in true position order under the zigzag layout (its causal mask is SDPA's own)"),
    Mutation("context-root-forgets-the-vocab-axis", "hp_functional/parallel/context/plugin.py::ContextParallelism.resolve",
             'style = root(axis, plan.settings["cp_layout"], resolution.vocab_axis)',
             'style = root(axis, plan.settings["cp_layout"], None)',
             ("tests/parallel/test_context_parallel_hf.py::test_llama_cp_times_tp_loss_parallel",),
             "context parallelism's root takes over loss parallel's: the loss from vocab-sharded logits"),
    Mutation("least-specific-pattern-wins", "hp_functional/core/paths.py::most_specific",
             "top = max(specificity(c.pattern) for c in cands)", "top = min(specificity(c.pattern) for c in cands)",
             ("tests/core/test_paths.py",), "the most specific pattern wins, whatever the entry order"),
    Mutation("concatenation-along-a-shard-accepted", "hp_functional/analysis/packing.py::concatenated",
             "    if len(pieces) < 2 or", "    if True or len(pieces) < 2 or",
             ("tests/planner/test_auto_plan_architectures.py::test_a_concatenation_of_sharded_features_into_one_rowwise_is_refused",),
             "a concatenation along a sharded dim into one Rowwise is refused, never silently wrong"),
    Mutation("parameter-derived-data-skips-the-boundary", "hp_functional/compile/dataflow.py::_hooks",
             "            elif isinstance(t, Tensor) and (kind := mode._kind(t)) is not None:",
             "            elif False:",
             ("tests/compile/test_gradient_proof.py::test_a_pair_on_parameter_derived_data_leaves_the_stream_replicated",),
             "a boundary's reduction applies to data computed from parameters alone (the norms after it keep their "
             "gradient)"),
    Mutation("enclosing-parameter-unchecked", "hp_functional/compile/dataflow.py::unchecked_in_regions",
             "near = is_below(name, region) or name == region or not name or is_below(region, name)",
             "near = is_below(name, region)",
             ("tests/runtime/test_example_inputs.py::test_a_root_parameter_reaching_a_region_is_refused_or_traced",),
             "without a batch, a root-level parameter reaching a sharded region is refused, never a per-rank share"),
    Mutation("feature-views-reorder-as-rows", "hp_functional/analysis/audit.py::_view",
             "rows = len(g.ins[0]) - 1 not in group[0] and len(g.outs[0]) - 1 not in group[1]", "rows = True",
             ("tests/analysis/test_audit_packed.py",),
             "only a view of leading (row) dims may land its division on an inner dim; one that regroups the "
             "features must cut whole heads"),
    Mutation("per-expert-bias-left-whole", "hp_functional/parallel/experts/styles.py::expert_params",
             "p.dim() >= 1 and p.shape[0] == n]", "p.dim() == 3 and p.shape[0] == n and '.' not in name]",
             ("tests/parallel/test_experts_params.py",),
             "every per-expert parameter of fused experts (stacked biases, a per-expert norm in a child) is sharded "
             "with its experts, never indexed whole by local expert ids"),
    Mutation("returned-parameter-reduced", "hp_functional/compile/regions.py::consumer_axes",
             "own = set(analysis[module].varying) - unvarying if module in analysis else set()",
             "own = set(analysis[module].varying) if module in analysis else set()",
             ("tests/compile/test_gradient_proof.py::test_a_parameter_the_attention_only_returns_takes_no_reduction",),
             "a parameter of a head-split module that is used only with replicated data gets no gradient reduction"),
    Mutation("pairs-span-the-residual-stream", "hp_functional/planner/blocks.py::_residual",
             "return is_norm(module) and", "return False and",
             ("tests/planner/test_auto_plan_architectures.py::test_architectures_are_exact",),
             "auto_plan pairs by dataflow without crossing a residual norm (a block's projections named as no "
             "table knows them)"),
)
