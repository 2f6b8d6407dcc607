"""Planted faults in the engines (`nanoddp/parallel/`): DDP, ZeRO, ZeRO-2 and FSDP."""

from __future__ import annotations

from mutations.fault import Mutation

FAULTS = (
    Mutation(
        "bucket averaging: DDP sums instead of averaging",
        "nanoddp/parallel/ddp/average.py",
        "        return tensor.mul_(1.0 / divisor)\n",  # the default path (gradients copied into buckets)
        "        return tensor\n",
        ("tests/multiproc/test_ddp_no_sync_values.py", "-k", "nanoddp"),
    ),
    Mutation(
        "no_sync: DDP reduces inside no_sync too",
        "nanoddp/parallel/ddp/wrapper.py",
        "reducer.sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync",
        "reducer.sync_this_backward = torch.is_grad_enabled()",
        ("tests/multiproc/test_ddp_no_sync_values.py", "-k", "nanoddp"),
    ),
    Mutation(
        "Join: the final model broadcast from rank 0, not the last joiner",
        "nanoddp/parallel/ddp/join.py",
        "src = common_rank(reducer, is_last_joiner)",
        "src = 0",
        ("tests/multiproc/test_ddp_join.py", "-k", "nanoddp-join-sgd-initial_ws"),
    ),
    Mutation(
        "Join: ZeRO's step() does not tell the context its rank still trains",
        "nanoddp/parallel/zero/stage1.py",
        "            Join.notify_join_context(self)",
        "            pass",
        ("tests/multiproc/test_zero_join.py", "-k", "zero_alone"),
    ),
    Mutation(
        "ZeRO broadcast: owners' updated parameters not sent",
        "nanoddp/parallel/zero/partition.py",
        "self.comm.broadcast(flat, src=self.global_ranks[owner], group=self.group)",
        "pass",
        # the whole-parameter partition is the one that broadcasts; its suite case checks values
        ("tests/multiproc/test_zero2_fsdp.py", "-k", "ws3 and zero1_parameter and not uneven"),
    ),
    Mutation(
        "ZeRO all-gather: updated shards not gathered",
        "nanoddp/parallel/zero/partition.py",
        "self.comm.all_gather_into_tensor(full, shard, group=self.group)",
        "pass",
        ("tests/multiproc/test_zero.py", "-k", "matches_plain_optimizer and 2"),
    ),
    Mutation(
        "sharded grads: ZeRO-2/FSDP sum instead of averaging",
        "nanoddp/parallel/zero/flat.py",
        "shard_grad.div_(self.world_size)",
        "pass",
        ("tests/multiproc/test_zero2_fsdp.py", "-k", "average_of_the_ranks"),
    ),
    Mutation(
        "fsdp: gradients summed instead of averaged",
        "nanoddp/parallel/fsdp/unit.py",
        "    return dist.ReduceOp.AVG if divide_factor is None else dist.ReduceOp.SUM",
        "    return dist.ReduceOp.SUM",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: backward prefetch never happens",
        "nanoddp/parallel/fsdp/state.py",
        "        return self._after(self.backward_order, state)",
        "        return []",
        ("tests/multiproc/test_fsdp_prefetch.py",),
    ),
    Mutation(
        "HSDP: no all-reduce across replicas",
        "nanoddp/parallel/fsdp/unit.py",
        "            self.comm.all_reduce(output, op=gradient_reduce_op(self.divide_factor), group=replicas)",
        "            pass",
        ("tests/multiproc/test_fsdp2_hsdp.py",),
    ),
    Mutation(
        "fsdp: every rank takes the first rows",
        "nanoddp/parallel/fsdp/state_dict.py",
        "            block = block.narrow(dim, start, length)\n",
        "            block = block.narrow(dim, 0, length)\n",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: gradients reduced in param_dtype",
        "nanoddp/parallel/fsdp/unit.py",
        "return self.mp.reduce_dtype or self.mp.param_dtype or",
        "return self.mp.param_dtype or self.mp.reduce_dtype or",
        ("tests/multiproc/test_fsdp2_parity.py", "-k", "2"),
    ),
    Mutation(
        "fsdp: load_state_dict(assign=True) shards not adopted",
        "nanoddp/parallel/fsdp/fully_shard.py",
        "        module.register_load_state_dict_post_hook(unit.adopt_registered)",
        "        pass",
        ("tests/multiproc/test_fsdp2_example.py",),
    ),
    Mutation(
        "fsdp optimizer state: every rank takes the first rows",
        "nanoddp/parallel/fsdp/state_dict.py",
        "    local = rows_of_whole(value.to(like.device), like.device_mesh, like.placements).to(like.dtype).clone()",
        "    local = value.to(like.device)[: like.to_local().shape[0]].to(like.dtype).clone()",
        # an optimizer that stepped before fully_shard: its state cut to each rank's rows
        ("tests/multiproc/test_fsdp_engine.py", "-k", "any_model"),
    ),
    Mutation(
        "fsdp optimizer state: dropped when the trainer rebinds parameters",
        "nanoddp/parallel/fsdp/state_dict.py",
        "optimizer.state[new] = optimizer.state.pop(old)",
        "optimizer.state.pop(old)",
        ("tests/multiproc/test_fsdp_engine.py", "-k", "any_model"),
    ),
    Mutation(
        "sharded fp16: the overflow check not all-reduced",
        "nanoddp/parallel/grad_scaler.py",
        "dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)",
        "pass",
        ("tests/multiproc/test_fsdp_engine.py", "-k", "grad_scaler"),
    ),
    Mutation(
        "DDP accepts an already sharded model",
        "nanoddp/parallel/ddp/wrapper.py",
        'refuse_sharded(module, "DistributedDataParallel")',
        "pass",
        ("tests/multiproc/test_fsdp_engine.py", "-k", "already_sharded"),
    ),
    Mutation(
        "fsdp auto-wrap: no size rule for unknown models",
        "nanoddp/parallel/fsdp/auto_wrap.py",
        "elif _numel(child) >= threshold and _numel(child) < _numel(model):",
        "elif False:",
        ("tests/multiproc/test_fsdp_engine.py", "-k", "auto_wrap_picks"),
    ),
    Mutation(
        "fsdp: an explicit reshard_after_forward ignored",
        "nanoddp/parallel/fsdp/state.py",
        "        return self.reshard_after_forward\n",
        "        return not self.is_root()\n",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "reshard_after_forward"),
    ),
    Mutation(
        "fsdp: the sharded grad overwritten, not accumulated, without zero_grad",
        "nanoddp/parallel/fsdp/param.py",
        "cast(DTensor, grad)._local_tensor.add_(local)",
        "cast(DTensor, grad)._local_tensor.copy_(local)",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "grads_accumulate"),
    ),
    Mutation(
        "fsdp: set_requires_gradient_sync(False) ignored",
        "nanoddp/parallel/fsdp/module.py",
        "            s.requires_gradient_sync = requires_gradient_sync\n",
        "            pass\n",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "gradient_sync"),
    ),
    Mutation(
        "HSDP: the gradient deferred by set_requires_all_reduce(False) dropped",
        "nanoddp/parallel/fsdp/unit.py",
        "                output += self._partial\n",
        "                pass\n",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "hsdp"),
    ),
    Mutation(
        "fsdp: ignored_params sharded anyway",
        "nanoddp/parallel/fsdp/fully_shard.py",
        "{id(p) for p in ignored_params or ()}",
        "set()",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "ignored_params"),
    ),
    Mutation(
        "fsdp: mp_policy.output_dtype ignored",
        "nanoddp/parallel/fsdp/state.py",
        "    return cast_floats(output, state.mp.output_dtype)\n\n\ndef pre_backward",
        "    return output\n\n\ndef pre_backward",
        # the last return of post_forward: a unit's output as it leaves the unit
        ("tests/multiproc/test_fsdp2_options.py", "-k", "mixed_precision"),
    ),
    Mutation(
        "fsdp: whole tensors held across a change of the shards reused (no stale check)",
        "nanoddp/parallel/fsdp/state.py",
        "        if unit.is_unsharded and unit.stale():\n            unit.reshard()\n",
        "        pass\n",
        # a forward after an eval forward (reshard_after_forward=False) runs the old weights
        ("tests/multiproc/test_fsdp2_options.py", "-k", "inplace_change"),
    ),
    Mutation(
        "fsdp: load_state_dict while whole tensors are held: no reshard first",
        "nanoddp/parallel/fsdp/fully_shard.py",
        "        module._register_load_state_dict_pre_hook(lambda *_: unit.reshard())\n",
        "        pass\n",
        ("tests/multiproc/test_fsdp2_options.py", "-k", "load_while_gathered"),
    ),
    Mutation(
        "localsgd: the replicas summed, not averaged",
        "nanoddp/parallel/lowcomm/average.py",
        "        flat.div_(world_size)\n",
        "        pass\n",
        ("tests/multiproc/test_lowcomm.py", "-k", "localsgd_matches_torch"),
    ),
    Mutation(
        "diloco: the pseudo-gradient points the wrong way",
        "nanoddp/parallel/lowcomm/diloco.py",
        "pseudo_grads = [synced - p for p, synced",
        "pseudo_grads = [p - synced for p, synced",
        ("tests/unit/test_lowcomm_alone.py", "-k", "diloco"),
    ),
)
