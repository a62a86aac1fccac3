"""The hooks that drive a model sharded on pshard (FSDP2's FSDPState): pre-forward gathers a
unit (and prefetches the next), post-forward reshards it; backward gathers each unit again
before its gradients are computed, reduce-scatters them asynchronously as soon as they are all
accumulated, and the final callback sets the sharded gradients. Also the global optimizer hooks
that tell the shard servers when a torch.optim optimizer stepped a pshard model in the
trainer."""
import weakref

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import pshard
from ._fsdp_init import lazy_init
from ._fsdp_param_group import unit_of

__all__ = ["pre_forward", "post_forward", "ensure_init", "install_optimizer_hooks"]


def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        out = [_cast(x, dtype) for x in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    elif hasattr(obj, "to_tuple"):  # transformers' ModelOutput
        _tensors(obj.to_tuple(), out)
    return out


def pre_forward(module, args, kwargs):
    u = unit_of(module)
    if u.model is None:
        _init(u)
    model = u.model
    if u is model.root:  # a new forward: nothing of an earlier one (that raised) is open
        model.cur_pre, model.cur_post = [], []
        for v in model.units:
            v.fwd_active = False
    if u.fwd_active:  # fully_shard([a, b]): b after a, in one forward of the unit
        return _cast_inputs(u, args, kwargs)
    u.fwd_active, u.fwd_done = True, 0
    model.cur_pre.append(u)
    u.unshard()
    # Prefetch: the explicit list, else the unit that ran after this one last time.
    if u.fwd_prefetch is not None:
        nxt = u.fwd_prefetch
    else:
        order = model.fwd_order
        k = order.index(u) if u in order else -1
        nxt = [order[k + 1]] if 0 <= k < len(order) - 1 else []
    for v in nxt:
        v.unshard_async()
    return _cast_inputs(u, args, kwargs)


def _cast_inputs(u, args, kwargs):
    if u.mp.cast_forward_inputs and u.mp.param_dtype is not None:
        args, kwargs = _cast(args, u.mp.param_dtype), _cast(kwargs, u.mp.param_dtype)
    return args, kwargs


def _init(root_unit):
    """The root's lazy initialisation, then the unsharded parameters' gradient hooks."""
    model = lazy_init(root_unit)
    for u in model.units:
        for i in u.grad_ids:
            fp = model.fsdp_params[i]
            fp.unsharded.register_post_accumulate_grad_hook(make_grad_hook(u, fp))
    return model


def ensure_init(root_unit):
    """The model of root_unit, initialised now if its first forward has not run yet."""
    if root_unit.model is None:
        _init(root_unit)
    return root_unit.model


def post_forward(module, args, output):
    u = unit_of(module)
    u.fwd_done += 1
    if u.fwd_done < len(u.module_refs):
        return output  # fully_shard([a, b]): the unit's forward ends with its last module's
    u.fwd_active = False
    model = u.model
    model.cur_post.append(u)
    if u is model.root:
        model.fwd_order, model.bwd_order = model.cur_pre, model.cur_post
    grad = torch.is_grad_enabled()
    # Without autograd there is no backward to gather for: every unit reshards (the root too).
    if u.reshards_after_forward() or not grad:
        u.reshard()
    if grad:
        outs = _tensors(output, [])
        if outs:
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads, u=u: _pre_backward(u), mode="any")
    if u.mp.output_dtype is not None:
        output = _cast(output, u.mp.output_dtype)
    return output


def _pre_backward(u):
    model = u.model
    if not model.callback_queued:
        model.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _post_backward_final(model))
    if u.in_backward:
        return
    u.in_backward = True
    u.ready = 0
    u.unshard()
    if u.bwd_prefetch is not None:
        nxt = u.bwd_prefetch
    else:
        order = model.bwd_order
        k = order.index(u) if u in order else -1
        nxt = [order[k - 1]] if k > 0 else []
    for v in nxt:
        v.unshard_async()
    if model.param_dtype == model.reduce_dtype and model.staged_on is None:
        # Autograd accumulates straight into the shared-memory full gradient buffers.
        for i in u.grad_ids:
            p = model.fsdp_params[i].unsharded
            view, fresh = _grad_view(model, i)
            if p.grad is None:
                if not fresh:
                    view.zero_()  # the caller dropped the accumulated gradient (zero_grad)
            elif p.grad is not view:
                view.copy_(p.grad)
            p.grad = view


def _grad_view(model, i):
    """(the torch view of parameter i's shared-memory full gradient buffer, whether it was just
    made): made once per reduction and dropped when the reduce-scatter starts."""
    view = model.grad_views.get(i)
    if view is not None:
        return view, False
    view = torch.from_dlpack(model.client.grad(i)).view(model.fsdp_params[i].sharded.shape)
    model.grad_views[i] = view
    return view, True


def make_grad_hook(u, fp):
    """The unsharded parameter's post-accumulate-grad hook: counts the unit's gradients and
    reduce-scatters the unit when all of them are in."""
    def hook(p):
        fp.had_grad = True
        u.ready += 1
        if u.ready == len(u.grad_ids):
            _post_backward(u)
    return hook


def _post_backward(u):
    if not u.in_backward:
        return
    u.in_backward = False
    model = u.model
    if model.param_dtype != model.reduce_dtype or model.staged_on is not None:
        # Gradients in another dtype or on the model's GPU: added into the host buffers
        # (synchronously: the reduce-scatter below reads them).
        for i in u.grad_ids:
            p = model.fsdp_params[i].unsharded
            view, _ = _grad_view(model, i)
            if p.grad is not None:
                view.add_(p.grad.to(view.device))
                p.grad = None
    for fp in u.params:
        if fp.frozen:
            fp.unsharded.grad = None
    hsdp = model.mesh.ndim == 2
    if u.requires_grad_sync and (u.requires_all_reduce or not hsdp) and u.grad_ids:
        if model.round_grads is not None or u.divide_factor is not None:
            scale = model.mean_over / u.divide_factor if u.divide_factor is not None else None
            for i in u.grad_ids:
                view, _ = _grad_view(model, i)
                if model.round_grads is not None:
                    view.copy_(view.to(model.round_grads))
                if scale is not None:
                    view.mul_(scale)
        for i in u.grad_ids:
            model.grad_views.pop(i, None)
            model.fsdp_params[i].unsharded.grad = None
        model.prepare_reduce_scatter(u.grad_ids)
        model.sync_device()
        model.pending.append(model.client.reduce_scatter_start(u.grad_ids))
        model.reduced = True
    if u.reshard_after_backward:
        u.reshard()


def _post_backward_final(model):
    model.callback_queued = False
    for u in model.units:
        if u.in_backward:
            _post_backward(u)
    model.finish_gradients()


# ---- torch.optim optimizers stepping a pshard model in the trainer ---------------------------

# optimizer -> the pshard models whose sharded parameters it holds (weakly), found at its
# first step
_OPT_MODELS = weakref.WeakKeyDictionary()
_HOOKS = []


def _models_of(opt):
    found = _OPT_MODELS.get(opt)
    if found is None:
        models, stale = {}, None
        for g in opt.param_groups:
            for p in g["params"]:
                if getattr(p, "_pshard_replaced", False) and stale is None:
                    stale = p
                ref = getattr(p, "_pshard_model_ref", None)
                m = ref() if ref is not None else None
                if m is not None:
                    models[id(m)] = ref
        if stale is not None:
            raise pshard.FailedPreconditionError(
                f"{type(opt).__name__} holds a parameter that fully_shard replaced (it was "
                "created before fully_shard): create the optimizer after fully_shard, from "
                "model.parameters(), which are the sharded DTensor parameters")
        found = list(models.values())
        if found:  # (a step before the first forward, DCP's state init, finds none yet)
            _OPT_MODELS[opt] = found
    return [m for m in (r() for r in found) if m is not None]


def _pre_step(opt, args, kwargs):
    if getattr(opt, "_pshard_server_side", False):
        return
    for model in _models_of(opt):
        if model.optimizers:
            raise pshard.FailedPreconditionError(
                f"{type(opt).__name__} would step a model that pshard.torch.optim optimizers "
                "step on the shard servers: use one kind for a model")
        model.before_trainer_step(opt)


def _post_step(opt, args, kwargs):
    if getattr(opt, "_pshard_server_side", False):
        return
    for model in _models_of(opt):
        model.trainer_step()


def install_optimizer_hooks():
    """Once per process: torch.optim's global step hooks that keep the shard servers told."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
        _HOOKS.append(register_optimizer_step_post_hook(_post_step))
