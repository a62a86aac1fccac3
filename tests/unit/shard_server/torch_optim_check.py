#!/usr/bin/env python3
"""Replays the optimizer trajectories that `unit_shard_optim --dump` prints with real
torch.optim (fp32 CPU tensors, single-tensor implementation) and compares the final parameters.
Registered as a test only when `import torch` works at configure time; exits 77 (skip) if
torch is missing at run time anyway.

Usage: torch_optim_check.py PATH/TO/unit_shard_optim
"""
import subprocess
import sys

try:
    import torch
except ImportError:
    print("torch is not installed; skipping")
    sys.exit(77)

REL_TOL = 1e-5
ABS_TOL = 1e-6  # about 10 fp32 ulps at 1.0, as in test_optim.c


def parse(text):
    cases, cur = [], None
    for line in text.splitlines():
        tag, *rest = line.split()
        if tag == "case":
            name, kind = rest[0], int(rest[1])
            lr, mom, damp = (float.fromhex(x) for x in rest[2:5])
            nesterov = rest[5] == "1"
            wd, b1, b2, eps = (float.fromhex(x) for x in rest[6:10])
            cur = dict(name=name, kind=kind, lr=lr, momentum=mom, dampening=damp,
                       nesterov=nesterov, weight_decay=wd, betas=(b1, b2), eps=eps,
                       lrs=[], grads=[])
            cases.append(cur)
        elif tag == "lr":
            cur["lrs"].append(float.fromhex(rest[0]))
        else:
            values = [float.fromhex(x) for x in rest]
            if tag == "grad":
                cur["grads"].append(values)
            else:
                cur[tag] = values
    return cases


def make_optimizer(case, param):
    common = dict(lr=case["lr"], weight_decay=case["weight_decay"], foreach=False)
    if case["kind"] == 0:
        return torch.optim.SGD([param], momentum=case["momentum"], dampening=case["dampening"],
                               nesterov=case["nesterov"], **common)
    cls = torch.optim.Adam if case["kind"] == 1 else torch.optim.AdamW
    return cls([param], betas=case["betas"], eps=case["eps"], **common)


def replay(case):
    param = torch.tensor(case["init"], dtype=torch.float32, requires_grad=True)
    opt = make_optimizer(case, param)
    for lr, grad in zip(case["lrs"], case["grads"]):
        for group in opt.param_groups:
            group["lr"] = lr
        param.grad = torch.tensor(grad, dtype=torch.float32)
        opt.step()
    return param.detach()


def main():
    out = subprocess.run([sys.argv[1], "--dump"], check=True, capture_output=True, text=True)
    cases = parse(out.stdout)
    if not cases:
        print("no trajectories in --dump output")
        return 1
    failures = 0
    for case in cases:
        want = replay(case)
        got = torch.tensor(case["final"], dtype=torch.float32)
        diff = (got - want).abs()
        bad = diff > REL_TOL * want.abs() + ABS_TOL
        exact = int((diff == 0).sum())
        status = "FAIL" if bool(bad.any()) else "ok"
        print(f"{case['name']}: {status} (max |diff| {float(diff.max()):.3g}, "
              f"{exact}/{len(want)} bit-identical)")
        failures += int(bad.any())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
