"""Models, data and single-process references shared by the pshard.torch tests and their
trainers (worker.py, run under pshardrun). Everything is built in code: an MLP and a tiny
GPT-2 (Hugging Face transformers, random init) trained byte-level on the text of the Python
standard library's own sources, so nothing is downloaded."""
import os

import torch


def make_model(cfg):
    torch.manual_seed(cfg.get("seed", 0))
    if cfg["model"] == "mlp":
        d = cfg.get("width", 16)
        m = torch.nn.Sequential(
            torch.nn.Linear(cfg.get("din", 8), d), torch.nn.LayerNorm(d), torch.nn.GELU(),
            torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, cfg.get("dout", 4)))
        if cfg.get("unused"):
            # Parameters in a unit that runs, which forward never uses: their grad stays
            # None, so torch's optimizers leave them alone (no weight decay, no state).
            m[0].spare = torch.nn.Linear(d, d)
        return m
    if cfg["model"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        c = GPT2Config(vocab_size=256, n_positions=cfg.get("seq", 16), n_embd=cfg.get("width", 32),
                       n_layer=cfg.get("layers", 2), n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, tie_word_embeddings=True)
        m = GPT2LMHeadModel(c)
        m.config.use_cache = False
        return m
    raise ValueError(cfg["model"])


def blocks(model, cfg):
    """The modules that get their own fully_shard unit (before the root)."""
    if cfg["model"] == "mlp":
        return [m for m in model if isinstance(m, torch.nn.Linear)][:-1]
    return list(model.transformer.h)


_TEXT = None


def text_bytes():
    global _TEXT
    if _TEXT is None:
        with open(os.__file__, "rb") as f:
            _TEXT = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    return _TEXT


def batch(cfg, rank, step):
    """Rank rank's batch at step (the same on every machine)."""
    g = torch.Generator().manual_seed(cfg.get("seed", 0) * 100003 + rank * 1009 + step)
    b = cfg.get("batch", 4)
    if cfg["model"] == "mlp":
        # A teacher task the model can learn: y = tanh(x W) for a fixed W.
        w = torch.randn(cfg.get("din", 8), cfg.get("dout", 4),
                        generator=torch.Generator().manual_seed(12345))
        x = torch.randn(b, cfg.get("din", 8), generator=g)
        return x, torch.tanh(x @ w)
    t = text_bytes()
    seq = cfg.get("seq", 16)
    starts = torch.randint(0, t.numel() - seq - 1, (b,), generator=g)
    return torch.stack([t[s:s + seq] for s in starts.tolist()]), None


def loss_of(model, cfg, x, y):
    if cfg["model"] == "mlp":
        return torch.nn.functional.mse_loss(model(x), y)
    return model(input_ids=x, labels=x).loss


def param_groups(model, cfg):
    """Two groups, as LM recipes do: no weight decay for biases and norms."""
    if not cfg.get("two_groups", False):
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": cfg.get("weight_decay", 0.1)},
            {"params": no_decay, "weight_decay": 0.0, "lr": cfg.get("lr", 1e-2) * 0.5}]


def make_optimizer(module, params, cfg):
    kind = cfg.get("optimizer", "adamw")
    lr = cfg.get("lr", 1e-2)
    extra = {"foreach": False} if module is torch.optim else {}
    if kind == "sgd":
        return module.SGD(params, lr=lr, momentum=cfg.get("momentum", 0.9), **extra)
    if kind == "adam":
        return module.Adam(params, lr=lr, **extra)
    return module.AdamW(params, lr=lr, weight_decay=cfg.get("weight_decay", 0.1), **extra)


def make_scheduler(opt, cfg):
    if not cfg.get("scheduler", False):
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def batches_of(cfg, rank):
    """How many steps rank trains for: steps, or with uneven: steps + rank (none with
    empty_rank == rank)."""
    if cfg.get("empty_rank") == rank:
        return 0
    return cfg["steps"] + (rank if cfg.get("uneven") else 0)


def reference(cfg, world):
    """Plain torch, one process, on the union of the ranks' batches: at each step the loss is
    the mean over the ranks that still have data (each rank's batch weighs the same), which is
    what pshard's averaged gradients compute. Returns (mean losses per step, state dict)."""
    dtype = torch.float64 if cfg.get("reference_fp64") else torch.float32
    model = make_model(cfg).to(dtype)
    for m in model.modules():
        if cfg.get("freeze") and isinstance(m, torch.nn.LayerNorm):
            for p in m.parameters():
                p.requires_grad_(False)
    opt = make_optimizer(torch.optim, param_groups(model, cfg), cfg)
    sched = make_scheduler(opt, cfg)
    accum = cfg.get("accum", 1)
    losses = []
    steps = max(batches_of(cfg, r) for r in range(world))
    for s in range(steps):
        # resume_world: from step `at` on, the run went on with fewer ranks (a checkpoint
        # saved on `world` ranks and resumed on another world size).
        w = world
        rw = cfg.get("resume_world")
        if rw and s >= rw["at"]:
            w = rw["world"]
        ranks = [r for r in range(w) if s < batches_of(cfg, r)]
        opt.zero_grad()
        total = 0.0
        # divide_factor: the ranks' gradients summed and divided by it instead of averaged;
        # reduce_fp16: each rank's gradient rounded to float16 before the (fp32) sum.
        divide = cfg.get("divide_factor") or len(ranks)
        per_rank = cfg.get("reduce_fp16", False)
        for r in ranks:
            held = [p.grad for p in model.parameters()] if per_rank else None
            if per_rank:
                for p in model.parameters():
                    p.grad = None
            for a in range(accum):
                x, y = batch(cfg, r, s * accum + a)
                if x.is_floating_point():
                    x, y = x.to(dtype), y.to(dtype)
                loss = loss_of(model, cfg, x, y) / (len(ranks) * accum)
                (loss * (len(ranks) / divide)).backward()
                total += loss.item()
            if per_rank:
                for p, h in zip(model.parameters(), held):
                    if p.grad is not None:
                        g = p.grad.to(torch.float16).to(p.grad.dtype)
                        p.grad = g if h is None else h + g
                    else:
                        p.grad = h
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        if sched:
            sched.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
