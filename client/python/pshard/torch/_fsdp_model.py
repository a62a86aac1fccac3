"""The state of one model sharded on pshard (what FSDP2 keeps on its root): the client, every
parameter and unit, the reduce-scatters in flight, the forward order for prefetching, and the
steps: pshard.torch.optim's on the shard servers, or a torch.optim optimizer's in the trainer
(which the servers are told of, so their step count, checkpoints and Join stay right)."""
import warnings

import torch
import torch.distributed as dist

import pshard
from ._optim_keep import KeptState

__all__ = ["Model"]


class Model:
    """The root's model state; see the module's doc."""

    def __init__(self, root_unit, client):
        self.client = client
        self.root = root_unit
        self.units = []
        self.fsdp_params = []      # FSDPParam per pshard id
        self.names = []
        self.frozen = []           # per id: never reduced or stepped
        self.grad_views = {}       # id -> the shared-memory full gradient view handed to torch
        self.pending = []          # reduce-scatter Works not yet waited on
        self.reduced_ids = []      # ids reduce-scattered since the sharded grads were set
        self.fwd_order = []        # units by pre-forward in the last forward (forward prefetch)
        self.bwd_order = []        # units by post-forward in the last forward (backward
                                   # prefetch walks it backwards, as FSDP2 does)
        self.cur_pre, self.cur_post = [], []
        self.callback_queued = False
        self.optimizers = []       # pshard.torch.optim optimizers (stepped on the servers)
        self.param_dtype = None
        self.reduce_dtype = None    # what the servers reduce in
        self.round_grads = None     # float16: gradients rounded to it before the reduction
        self.mean_over = 1          # the ranks the servers average gradients over
        self.step = 0
        self.last_grad_norm = None
        self.reduced = False       # a reduce-scatter was issued since the last step
        self.group_src = []
        self.mesh = None           # the torch DeviceMesh of every unit
        self.staged_on = None      # the device of staged unsharded parameters (a GPU model;
        #                            the CPU under PSHARD_TEST_EMULATE_DEVICE=1), or None
        self.shards_on = None      # the CUDA device of GPU-resident sharded parameters, or None
        # A torch.optim optimizer's state kept for a replacement trainer (KeptState), while
        # the shard servers allow one; keep_checked: whether they were asked.
        self.keeper = None
        self.keep_checked = False

    def sync_device(self):
        """GPU-resident shards: the shard servers read what this trainer's kernels wrote into
        them (torch.optim's updates, zeroed gradients, loaded state) or into the model region
        in their GPU memory (the gradients added for a reduce-scatter), and overwrite what its
        kernels read there (a fill's copy out of a gathered buffer), only once those kernels
        finished; called before every operation of the servers on the shards."""
        if self.shards_on is not None:
            torch.cuda.synchronize(self.shards_on)

    @property
    def params(self):
        """The unsharded parameters by pshard id (what forward and backward use)."""
        return [fp.unsharded for fp in self.fsdp_params]

    def wait_reductions(self):
        pending, self.pending = self.pending, []
        first = None
        for w in pending:
            try:
                w.wait()
            except pshard.Error as e:
                first = first or e
        if first is not None:
            raise first

    def finish_gradients(self):
        """After backward: waits for the reduce-scatters and sets each reduced parameter's
        sharded .grad (a DTensor over the server's accumulator). A parameter no rank produced
        a gradient for keeps its .grad (None after zero_grad), as torch and FSDP2 leave it; one
        small all-reduce over the ranks decides that."""
        self.wait_reductions()
        ids, self.reduced_ids = self.reduced_ids, []
        if not ids:
            return
        had = torch.tensor([1 if self.fsdp_params[i].had_grad else 0 for i in ids],
                           dtype=torch.uint8)
        dist.all_reduce(had, op=dist.ReduceOp.MAX)  # every rank of the model (the world)
        for i, h in zip(ids, had.tolist()):
            fp = self.fsdp_params[i]
            fp.had_grad = False
            if h and fp.grad_local is not None and fp.sharded.grad is None:
                fp.sharded.grad = fp.sharded_grad()

    def prepare_reduce_scatter(self, ids):
        """Before ids' reduce-scatter: a parameter whose sharded .grad is None (a new step,
        zero_grad) starts from zero on the server instead of adding to what it held."""
        for i in ids:
            fp = self.fsdp_params[i]
            if fp.sharded.grad is None and fp.grad_local is not None:
                fp.grad_local.zero_()
        self.reduced_ids.extend(ids)

    def optimizer_step(self, opt):
        """A pshard.torch.optim optimizer's step(): the pending reduce-scatters, then every
        group's hyperparameters to the servers, which update their slices."""
        if opt not in self.optimizers:
            raise pshard.FailedPreconditionError("this optimizer does not hold the model")
        if not self.reduced:
            raise pshard.FailedPreconditionError(
                "step() before backward: no gradients were reduce-scattered since the last "
                "step (with set_requires_gradient_sync(False), turn it back on for the last "
                "micro-batch)")
        self.finish_gradients()
        groups = []
        for g, frozen in self.group_src:
            d = opt._pshard_group_dict(g) if g is not None else {"lr": 0.0}
            d["frozen"] = frozen
            groups.append(d)
        # torch.optim skips a parameter whose .grad is None (no rank produced one): so do the
        # servers, leaving its values, state and own step count alone.
        skip = bytearray((len(self.fsdp_params) + 7) // 8)
        for i, fp in enumerate(self.fsdp_params):
            if fp.sharded.grad is None:
                skip[i // 8] |= 1 << (i % 8)
        self.sync_device()
        self.step, self.last_grad_norm = self.client.step(groups=groups, skip=bytes(skip))
        self.after_step()

    def before_trainer_step(self, opt):
        """Before a torch.optim optimizer steps the model in the trainer: with the shard
        servers allowing a replacement trainer (--trainer-replace-ms), its state is kept where
        a replacement finds it, with the values the step starts from (_optim_keep)."""
        self.finish_gradients()
        if not self.keep_checked:
            self.keep_checked = True
            try:
                a, b, replace_ms = self.client.trainer_state_info()
            except pshard.Error:
                replace_ms = 0  # the shard is not mapped: the optimizer cannot step it anyway
            if replace_ms > 0 and self.keeper is None:
                self.keeper = KeptState(self, (a, b))
        if self.keeper is not None:
            self._kept_or_not(self.keeper.before_step(opt))

    def _kept_or_not(self, why):
        if why is not None:
            self.keeper = None
            warnings.warn(
                f"pshard: rank {self.client.rank} cannot keep its torch.optim optimizer's state "
                f"for a replacement trainer ({why}): if this trainer is lost, the job ends",
                RuntimeWarning, stacklevel=4)

    def trainer_step(self):
        """After a torch.optim optimizer updated the sharded parameters in the trainer (their
        local tensors are the servers' masters): the servers count the step (checkpoints,
        get_step, Join's check that no joined rank's shard goes stale; the commit a
        replacement goes by) and every unit is resharded on the client (its gathered values
        are the old ones)."""
        self.finish_gradients()
        kept = self.keeper
        if kept is not None:
            self._kept_or_not(kept.after_update(kept.opt))
            kept = self.keeper
        try:
            self.sync_device()
            self.step = self.client.step_trainer(kept=kept is not None)
        except pshard.StepAbortedError:
            if kept is not None:  # it may have counted elsewhere: resync says
                kept.unsettled = True
            raise
        if kept is not None:
            kept.committed(self.step)
        self.reduced = False
        for u in self.units:
            u.to_sharded()

    def after_step(self):
        """The servers stepped: their accumulators are zero and every parameter is sharded
        again on the client; the sharded gradients are dropped (they would read zeros)."""
        self.reduced = False
        for u in self.units:
            u.to_sharded()
        for fp in self.fsdp_params:
            fp.sharded.grad = None

    def resync(self):
        """After pshard.StepAbortedError (a trainer of the job was lost; none of the step in
        flight was applied on any rank): forgets the step's gradients and gathers, waits until
        the shard servers rebuilt their ring and returns the step whose data comes next."""
        self.reset_after_error()
        for fp in self.fsdp_params:
            fp.sharded.grad = None
        self.reduced = False
        nxt = self.client.resync()
        self.step = self.client.model_step
        if self.keeper is not None and self.keeper.unsettled:
            # The commit of a torch.optim step failed here: the servers counted it everywhere
            # or nowhere, and the values follow.
            self.keeper.settle(self.step)
        return nxt

    def reset_after_error(self):
        """Forgets per-iteration state after a failed or joined iteration."""
        self.pending = []
        self.reduced_ids = []
        for u in self.units:
            u.gather_work = None
            u.in_backward = False
            u.ready = 0
            u.to_sharded()
        self.grad_views.clear()
        for fp in self.fsdp_params:
            fp.had_grad = False
            if fp.unsharded is not None:
                fp.unsharded.grad = None
        self.callback_queued = False
