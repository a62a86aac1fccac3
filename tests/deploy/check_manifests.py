#!/usr/bin/env python3
"""Checks of our own on pshard's rendered Kubernetes manifests, for what the API schemas
cannot see: that selectors select, that probes point at the port the binary really listens
on, that every referenced ConfigMap and Secret exists, that every PSHARD_* variable set is one
the program in that container reads, the security settings, the settings
the rendezvous, the shared-memory data path and the NetworkPolicy depend on, the recommended
labels, and, for custom resources without a schema here (JobSet, PodMonitor), the fields we use
(the Job inside a JobSet is checked against the Kubernetes schema as a Job).

The binaries' own option tables (their --help) decide what a flag or environment variable
means and what the defaults are, so a renamed option or a changed default fails here.

  check_manifests.py --overlay cpu|gpu|jobset --coordinator-bin BIN --server-bin BIN RENDERED.yaml
  check_manifests.py --self-test --coordinator-bin BIN --server-bin BIN CPU.yaml GPU.yaml JOBSET.yaml

--self-test breaks the rendered manifests in one way per check and makes sure that check (and
only a check, never a crash) reports it: every check must be able to fail.
Exit status: 0 all checks pass, 1 a check failed, 2 usage or input errors.
"""
import argparse
import copy
import glob
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

COORDINATOR = "pshard-coordinator"
SERVER = "pshard-server"
# Health service a binary's readiness probe asks for. A shard server: pshard.ShardServer, its
# rank can serve its trainer. The coordinator: "" (it serves). Its pshard.Cluster follows only
# the coordinator's default job, and every trainer Job here is a job of its own (PSHARD_JOB),
# so a coordinator probed on pshard.Cluster would never be ready.
READY_SERVICE = {COORDINATOR: "", SERVER: "pshard.ShardServer"}
WORKLOADS = ("Deployment", "StatefulSet", "Job", "JobSet")
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_UID = "metadata.labels['batch.kubernetes.io/controller-uid']"
OVERLAYS = ("cpu", "gpu", "jobset")
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                      "app.kubernetes.io/version", "app.kubernetes.io/component",
                      "app.kubernetes.io/part-of")
# Kubernetes versions the Job inside a JobSet is validated against (check-manifests.sh's).
K8S_VERSIONS = ("1.29.0", "1.34.0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Binary:
    """A pshard binary's option table, read from its --help: flag -> (env names, default)."""

    def __init__(self, path):
        self.path = path
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise SystemExit(f"check_manifests: {path} --help failed: {out.stderr.strip()}")
        self.options = {}
        for line in out.stdout.splitlines():
            m = re.match(r"\s+(--[a-z0-9-]+)(?: VALUE)?\s+.*?(?:\(([^()]*)\))?\s*$", line)
            if not m:
                continue
            env, default = [], None
            for part in (m.group(2) or "").split(";"):
                part = part.strip()
                if part.startswith("env: "):
                    env = [e.strip() for e in part[5:].split(",")]
                elif part.startswith("default: "):
                    default = part[9:]
            self.options[m.group(1)] = (env, default)
        with open(path, "rb") as f:
            self.image = f.read()

    def has_string(self, s):
        return s.encode() in self.image


# ---------------------------------------------------------------------------------------------
# Reading the rendered objects


def pod_specs(docs):
    """(workload, pod template) for every Deployment, StatefulSet and Job, and for every
    replicated Job of a JobSet."""
    for d in docs:
        if d.get("kind") == "JobSet":
            for rj in (d.get("spec") or {}).get("replicatedJobs") or []:
                yield d, rj["template"]["spec"]["template"]
        elif d.get("kind") in WORKLOADS:
            yield d, d["spec"]["template"]


def job_specs(docs):
    """(workload, Job spec) for every Job and every replicated Job of a JobSet."""
    for d in docs:
        if d.get("kind") == "Job":
            yield d, d["spec"]
        elif d.get("kind") == "JobSet":
            for rj in (d.get("spec") or {}).get("replicatedJobs") or []:
                yield d, rj["template"]["spec"]


def containers(pod):
    """The containers that run for the pod's life: native sidecars (init containers with
    restartPolicy Always) and the main containers."""
    spec = pod["spec"]
    return [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"] \
        + (spec.get("containers") or [])


def name_of(d):
    return f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"


def find(docs, kind, name, namespace=None):
    for d in docs:
        md = d.get("metadata", {})
        if d.get("kind") == kind and md.get("name") == name and (
                namespace is None or md.get("namespace") == namespace):
            return d
    return None


def labels_match(selector, labels):
    """True if a matchLabels selector (dict) selects an object with these labels."""
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def match_labels(sel, where, errors):
    """A LabelSelector's matchLabels; matchExpressions are not used in our manifests."""
    sel = sel or {}
    if sel.get("matchExpressions"):
        errors.append(f"{where}: matchExpressions are not checked here; use matchLabels")
    return sel.get("matchLabels") or {}


def binary_of(container):
    """Which pshard binary a container runs ('' for anything else, e.g. a trainer)."""
    argv = (container.get("command") or []) + (container.get("args") or [])
    if argv:
        base = argv[0].rsplit("/", 1)[-1]
        if base in (COORDINATOR, SERVER):
            return base
    return ""


def container_env(docs, d, container):
    """The container's environment as Kubernetes builds it: envFrom first, then env (which
    wins), with $(VAR) references expanded. Downward-API values read '<fieldRef:PATH>'."""
    ns = d["metadata"].get("namespace")
    env = {}
    for ef in container.get("envFrom") or []:
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in ef:
                obj = find(docs, kind, ef[key].get("name"), ns)
                for k, v in ((obj or {}).get("data") or {}).items():
                    env[(ef.get("prefix") or "") + k] = str(v)
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                    lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        elif "valueFrom" in e:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = f"<fieldRef:{vf['fieldRef'].get('fieldPath')}>"
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                obj = find(docs, "ConfigMap", ref.get("name"), ns) or {}
                env[e["name"]] = str((obj.get("data") or {}).get(ref.get("key"), ""))
            else:
                env[e["name"]] = "<valueFrom>"
    return env


def effective(binary, flag, container, env):
    """The value a binary ends up with for one option: flag > environment > default."""
    argv = (container.get("command") or []) + (container.get("args") or [])
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    names, default = binary.options.get(flag, ([], None))
    for n in names:
        if n in env:
            return env[n]
    return default


def split_port(addr):
    host, _, port = (addr or "").rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def container_ports(pod):
    """containerPort numbers by name and the set of numbers, over all containers."""
    by_name, numbers = {}, set()
    for c in containers(pod):
        for p in c.get("ports") or []:
            numbers.add(p["containerPort"])
            if p.get("name"):
                by_name[p["name"]] = p["containerPort"]
    return by_name, numbers


def resolve_target_port(pod, target):
    by_name, numbers = container_ports(pod)
    if isinstance(target, int):
        return target if target in numbers else None
    return by_name.get(target)


CPU_UNITS = {"m": 1e-3, "": 1.0}
MEM_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12, "": 1.0}


def quantity(q, units):
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    if not m or m.group(2) not in units:
        return None
    return float(m.group(1)) * units[m.group(2)]


# ---------------------------------------------------------------------------------------------
# The checks. Each returns a list of error messages (empty: passed).


def check_selectors(docs, ctx):
    """Workload selectors match their templates; Services, PDBs and NetworkPolicies select
    pods that exist; Service target ports exist; a StatefulSet's serviceName is a headless
    Service that selects it."""
    errors = []
    templates = []
    for d, pod in pod_specs(docs):
        labels = pod.get("metadata", {}).get("labels") or {}
        if d["kind"] in ("Job", "JobSet"):   # the Job controller makes their selectors
            templates.append((d, pod, labels))
            continue
        sel = match_labels(d["spec"].get("selector"), name_of(d), errors)
        if not labels_match(sel, labels):
            errors.append(f"{name_of(d)}: selector {sel} does not match template labels {labels}")
        templates.append((d, pod, labels))

    def selected(sel, ns):
        return [(d, pod) for d, pod, labels in templates
                if d["metadata"].get("namespace") == ns and labels_match(sel, labels)]

    for d in docs:
        ns = d.get("metadata", {}).get("namespace")
        kind = d.get("kind")
        if kind == "Service":
            sel = d["spec"].get("selector") or {}
            pods = selected(sel, ns)
            if not pods:
                errors.append(f"{name_of(d)}: selector {sel} selects no pod template")
            for port in d["spec"].get("ports") or []:
                target = port.get("targetPort", port.get("port"))
                for w, pod in pods:
                    if resolve_target_port(pod, target) is None:
                        errors.append(f"{name_of(d)}: targetPort {target!r} is not a container "
                                      f"port of {name_of(w)}")
        elif kind == "PodDisruptionBudget":
            sel = match_labels(d["spec"].get("selector"), name_of(d), errors)
            if not selected(sel, ns):
                errors.append(f"{name_of(d)}: selector {sel} selects no pod template")
        elif kind == "NetworkPolicy":
            sel = match_labels(d["spec"].get("podSelector"), name_of(d), errors)
            if not selected(sel, ns):
                errors.append(f"{name_of(d)}: podSelector {sel} selects no pod template")
            for rule in d["spec"].get("ingress") or []:
                for peer in rule.get("from") or []:
                    if "podSelector" in peer:
                        psel = match_labels(peer["podSelector"], name_of(d), errors)
                        if not selected(psel, ns):
                            errors.append(f"{name_of(d)}: from podSelector {psel} selects no "
                                          f"pod template")
    for d, pod, labels in templates:
        if d["kind"] != "StatefulSet":
            continue
        svc = find(docs, "Service", d["spec"].get("serviceName"), d["metadata"].get("namespace"))
        if not svc:
            errors.append(f"{name_of(d)}: serviceName {d['spec'].get('serviceName')!r} is not a "
                          f"Service here")
        elif svc["spec"].get("clusterIP") != "None":
            errors.append(f"{name_of(d)}: {name_of(svc)} is not headless (clusterIP: None)")
        elif not labels_match(svc["spec"].get("selector"), labels):
            errors.append(f"{name_of(d)}: {name_of(svc)} does not select its pods")
    return errors


def check_probes(docs, ctx):
    """Each server container has gRPC liveness ("" service) and readiness (READY_SERVICE, which
    the binary must contain) probes on its container port, and that port is the
    one the binary listens on after flags, environment and its built-in default; it listens on
    all interfaces so that kubelet reaches it."""
    errors = []
    for d, pod in pod_specs(docs):
        _, numbers = container_ports(pod)
        for c in containers(pod):
            which = binary_of(c)
            if not which:
                continue
            binary = ctx["bins"][which]
            where = f"{name_of(d)} container {c['name']}"
            env = container_env(docs, d, c)
            listen = effective(binary, "--listen", c, env)
            host, port = split_port(listen)
            if not port:
                errors.append(f"{where}: {which} listens on {listen!r}: no fixed port for probes")
            if host not in ("0.0.0.0", "::"):
                errors.append(f"{where}: {which} listens on {listen!r}, not on all interfaces")
            own_ports = {p["containerPort"] for p in c.get("ports") or []}
            if port and port not in own_ports:
                errors.append(f"{where}: listen port {port} is not among its container ports "
                              f"{sorted(own_ports)}")
            for kind, want_service in (("livenessProbe", ""),
                                       ("readinessProbe", READY_SERVICE[which])):
                probe = c.get(kind)
                if not probe or "grpc" not in probe:
                    errors.append(f"{where}: no gRPC {kind}")
                    continue
                pport = probe["grpc"].get("port")
                if pport != port:
                    errors.append(f"{where}: {kind} port {pport} is not the listen port {port}")
                if pport not in own_ports or pport not in numbers:
                    errors.append(f"{where}: {kind} port {pport} is not a container port")
                service = probe["grpc"].get("service", "")
                if service != want_service:
                    errors.append(f"{where}: {kind} asks for health service {service!r}, "
                                  f"expected {want_service!r}")
                if service and not binary.has_string(service):
                    errors.append(f"{where}: {binary.path} knows no health service {service!r}")
    return errors


def check_addresses(docs, ctx):
    """The addresses containers dial: PSHARD_COORDINATOR names a Service whose port leads to
    the coordinator's listen port; a trainer's PSHARD_SERVER is its own pod's shard server on
    localhost (the shared-memory path needs the same host)."""
    errors = []
    coord_port = None
    for d, pod in pod_specs(docs):
        for c in containers(pod):
            if binary_of(c) == COORDINATOR:
                env = container_env(docs, d, c)
                coord_port = split_port(
                    effective(ctx["bins"][COORDINATOR], "--listen", c, env))[1]
    for d, pod in pod_specs(docs):
        ns = d["metadata"].get("namespace")
        server_port = None
        for c in containers(pod):
            if binary_of(c) == SERVER:
                env = container_env(docs, d, c)
                server_port = split_port(effective(ctx["bins"][SERVER], "--listen", c, env))[1]
                target = effective(ctx["bins"][SERVER], "--coordinator", c, env)
                host, port = split_port(target)
                svc = find(docs, "Service", host.split(".")[0], ns)
                if not svc:
                    errors.append(f"{name_of(d)}: --coordinator {target!r} is no Service here")
                    continue
                sport = [p for p in svc["spec"].get("ports") or [] if p.get("port") == port]
                if not sport:
                    errors.append(f"{name_of(d)}: {name_of(svc)} has no port {port}")
                    continue
                coord_pods = [p for w, p in pod_specs(docs)
                              if labels_match(svc["spec"].get("selector"),
                                              p["metadata"].get("labels"))]
                for p in coord_pods:
                    tp = resolve_target_port(p, sport[0].get("targetPort", port))
                    if tp != coord_port:
                        errors.append(f"{name_of(svc)} port {port} leads to {tp}, but the "
                                      f"coordinator listens on {coord_port}")
        for c in containers(pod):
            if binary_of(c):
                continue
            env = container_env(docs, d, c)
            if "PSHARD_SERVER" not in env:
                continue
            host, port = split_port(env["PSHARD_SERVER"])
            if host not in ("127.0.0.1", "localhost") or port != server_port:
                errors.append(f"{name_of(d)} container {c['name']}: PSHARD_SERVER="
                              f"{env['PSHARD_SERVER']!r} is not this pod's shard server "
                              f"(127.0.0.1:{server_port})")
    return errors


def check_references(docs, ctx):
    """Every ConfigMap and Secret a pod refers to (envFrom, env valueFrom, volumes, projected
    volumes), and every key it names, exists in the pod's namespace."""
    errors = []

    def need(where, kind, name, ns, keys=()):
        obj = find(docs, kind, name, ns)
        if obj is None:
            errors.append(f"{where}: {kind} {name!r} does not exist in namespace {ns}")
            return
        have = set((obj.get("data") or {})) | set((obj.get("stringData") or {})) | set(
            (obj.get("binaryData") or {}))
        for k in keys:
            if k not in have:
                errors.append(f"{where}: {kind} {name!r} has no key {k!r}")

    for d, pod in pod_specs(docs):
        ns = d["metadata"].get("namespace")
        spec = pod["spec"]
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            where = f"{name_of(d)} container {c['name']}"
            for ef in c.get("envFrom") or []:
                if "configMapRef" in ef:
                    need(where, "ConfigMap", ef["configMapRef"].get("name"), ns)
                if "secretRef" in ef:
                    need(where, "Secret", ef["secretRef"].get("name"), ns)
            for e in c.get("env") or []:
                vf = e.get("valueFrom") or {}
                if "configMapKeyRef" in vf:
                    r = vf["configMapKeyRef"]
                    need(where, "ConfigMap", r.get("name"), ns, [r.get("key")])
                if "secretKeyRef" in vf:
                    r = vf["secretKeyRef"]
                    need(where, "Secret", r.get("name"), ns, [r.get("key")])
            vols = {v["name"] for v in spec.get("volumes") or []}
            for m in c.get("volumeMounts") or []:
                if m["name"] not in vols:
                    errors.append(f"{where}: mounts volume {m['name']!r} the pod does not have")
        for v in spec.get("volumes") or []:
            where = f"{name_of(d)} volume {v['name']}"
            sources = [v] + [s for s in (v.get("projected") or {}).get("sources") or []]
            for s in sources:
                if "configMap" in s:
                    keys = [i["key"] for i in s["configMap"].get("items") or []]
                    need(where, "ConfigMap", s["configMap"].get("name"), ns, keys)
                if "secret" in s:
                    sec = s["secret"]
                    keys = [i["key"] for i in sec.get("items") or []]
                    need(where, "Secret", sec.get("secretName", sec.get("name")), ns, keys)
        # The token file every pshard container is pointed at must be in a mounted Secret.
        for c in containers(pod):
            env = container_env(docs, d, c)
            tf = env.get("PSHARD_TOKEN_FILE")
            if not tf:
                continue
            mounts = [m for m in c.get("volumeMounts") or []
                      if tf.startswith(m["mountPath"].rstrip("/") + "/")]
            vol = [v for v in spec.get("volumes") or []
                   if mounts and v["name"] == mounts[0]["name"]]
            if not vol or "secret" not in vol[0]:
                errors.append(f"{name_of(d)} container {c['name']}: PSHARD_TOKEN_FILE={tf} is "
                              f"not in a mounted Secret")
                continue
            key = tf[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
            need(f"{name_of(d)} container {c['name']}", "Secret",
                 vol[0]["secret"].get("secretName"), ns, [key])
    return errors


# Where a PSHARD_* variable is read from the environment in pshard's sources, by what reads it:
# the binaries' option tables cover their flags, these the variables read directly.
SERVER_SOURCES = ("common", "collectives", "shard_server", "ckpt")
COORDINATOR_SOURCES = ("common", "coordinator")
TRAINER_SOURCES = ("common", "client")
ENV_READ = re.compile(r"""(?:getenv\(|environ(?:\.get\(|\[))\s*["'](PSHARD_[A-Z0-9_]+)["']""")


def source_env(dirs):
    """PSHARD_* names read with getenv() / os.environ in the C and Python sources under dirs
    (relative to the repository root)."""
    names = set()
    for top in dirs:
        for path in glob.glob(os.path.join(ROOT, top, "**", "*.[ch]"), recursive=True) + \
                glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True):
            with open(path, errors="replace") as f:
                names.update(ENV_READ.findall(f.read()))
    return names


def check_environment(docs, ctx):
    """Every PSHARD_* variable a manifest sets is one that what runs in the container reads: a
    pshard binary's option table (or its libraries' sources), the client library for a
    trainer; every PSHARD_* key of a ConfigMap is read by one of them. A misspelt or removed
    variable would otherwise be ignored without a word."""
    errors = []
    bins = ctx["bins"]
    read = {COORDINATOR: {n for env, _ in bins[COORDINATOR].options.values() for n in env}
            | source_env(COORDINATOR_SOURCES),
            SERVER: {n for env, _ in bins[SERVER].options.values() for n in env}
            | source_env(SERVER_SOURCES),
            "trainer": source_env(TRAINER_SOURCES)}
    anyone = set().union(*read.values())
    for d, pod in pod_specs(docs):
        for c in containers(pod):
            who = binary_of(c) or ("trainer" if any(
                e["name"] == "PSHARD_SERVER" for e in c.get("env") or []) else "")
            if not who:
                continue
            for e in c.get("env") or []:
                if e["name"].startswith("PSHARD_") and e["name"] not in read[who]:
                    errors.append(f"{name_of(d)} container {c['name']}: sets {e['name']}, which "
                                  f"{who} does not read")
    for d in docs:
        if d.get("kind") != "ConfigMap":
            continue
        for k in (d.get("data") or {}):
            if k.startswith("PSHARD_") and k not in anyone:
                errors.append(f"{name_of(d)}: key {k} is read by no pshard program")
    return errors


def check_security(docs, ctx):
    """Non-root, read-only root filesystem, no privilege escalation, every capability dropped,
    RuntimeDefault seccomp, no service-account token, no service-link environment, and the
    image's ENTRYPOINT (tini, PID 1) left in place; the namespace enforces the 'restricted'
    Pod Security Standard."""
    errors = []
    for d, pod in pod_specs(docs):
        spec = pod["spec"]
        psc = spec.get("securityContext") or {}
        if spec.get("automountServiceAccountToken") is not False:
            errors.append(f"{name_of(d)}: automountServiceAccountToken is not false")
        if spec.get("enableServiceLinks") is not False:
            errors.append(f"{name_of(d)}: enableServiceLinks is not false (service links put "
                          f"PSHARD_*_PORT variables into the environment)")
        if spec.get("hostNetwork") or spec.get("hostIPC") or spec.get("hostPID"):
            errors.append(f"{name_of(d)}: uses host namespaces")
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            where = f"{name_of(d)} container {c['name']}"
            csc = c.get("securityContext") or {}

            def eff(key):
                return csc.get(key, psc.get(key))

            if eff("runAsNonRoot") is not True:
                errors.append(f"{where}: runAsNonRoot is not true")
            if eff("runAsUser") in (0, None):
                errors.append(f"{where}: runAsUser is root or unset")
            if csc.get("readOnlyRootFilesystem") is not True:
                errors.append(f"{where}: readOnlyRootFilesystem is not true")
            if csc.get("allowPrivilegeEscalation") is not False:
                errors.append(f"{where}: allowPrivilegeEscalation is not false")
            if csc.get("privileged"):
                errors.append(f"{where}: privileged")
            caps = csc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []):
                errors.append(f"{where}: capabilities.drop does not contain ALL")
            if caps.get("add"):
                errors.append(f"{where}: adds capabilities {caps['add']}")
            if (eff("seccompProfile") or {}).get("type") != "RuntimeDefault":
                errors.append(f"{where}: seccompProfile is not RuntimeDefault")
            if c.get("command"):
                errors.append(f"{where}: sets command, which replaces the image's ENTRYPOINT "
                              f"(tini as PID 1); use args")
        ns = find(docs, "Namespace", d["metadata"].get("namespace"))
        if not ns:
            errors.append(f"{name_of(d)}: its namespace is not part of the manifests")
        elif (ns["metadata"].get("labels") or {}).get(
                "pod-security.kubernetes.io/enforce") != "restricted":
            errors.append(f"{name_of(ns)}: does not enforce the restricted Pod Security Standard")
    return errors


def check_resources(docs, ctx):
    """Every container requests and limits cpu and memory, requests not above limits; an
    extended resource (a GPU) has requests equal to limits."""
    errors = []
    for d, pod in pod_specs(docs):
        for c in (pod["spec"].get("initContainers") or []) + pod["spec"].get("containers", []):
            where = f"{name_of(d)} container {c['name']}"
            res = c.get("resources") or {}
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            for r, units in (("cpu", CPU_UNITS), ("memory", MEM_UNITS)):
                if r not in req or r not in lim:
                    errors.append(f"{where}: no {r} request and limit")
                    continue
                rq, lm = quantity(req[r], units), quantity(lim[r], units)
                if rq is None or lm is None:
                    errors.append(f"{where}: cannot read {r} {req[r]!r}/{lim[r]!r}")
                elif rq > lm:
                    errors.append(f"{where}: {r} request {req[r]} above limit {lim[r]}")
            for r in set(req) | set(lim):
                if "/" in r and str(req.get(r, lim.get(r))) != str(lim.get(r)):
                    errors.append(f"{where}: {r} request {req.get(r)} differs from limit "
                                  f"{lim.get(r)}")
    return errors


def check_shm(docs, ctx):
    """The trainer runs in the shard server's pod and both mount one memory-backed emptyDir
    at /dev/shm."""
    errors = []
    found = False
    for d, pod in pod_specs(docs):
        ctrs = containers(pod)
        servers = [c for c in ctrs if binary_of(c) == SERVER]
        if not servers:
            continue
        found = True
        trainers = [c for c in ctrs
                    if not binary_of(c) and "PSHARD_SERVER" in container_env(docs, d, c)]
        if not trainers:
            errors.append(f"{name_of(d)}: no trainer container (one with PSHARD_SERVER) in the "
                          f"shard server's pod")
        vols = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        shm_vols = set()
        for c in servers + trainers:
            m = [m for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
            if not m:
                errors.append(f"{name_of(d)} container {c['name']}: nothing mounted at /dev/shm")
                continue
            shm_vols.add(m[0]["name"])
            v = vols.get(m[0]["name"]) or {}
            if (v.get("emptyDir") or {}).get("medium") != "Memory":
                errors.append(f"{name_of(d)} container {c['name']}: /dev/shm is not an emptyDir "
                              f"with medium: Memory")
            if m[0].get("readOnly"):
                errors.append(f"{name_of(d)} container {c['name']}: /dev/shm is read-only")
        if len(shm_vols) > 1:
            errors.append(f"{name_of(d)}: trainer and shard server mount different /dev/shm "
                          f"volumes {sorted(shm_vols)}")
    if not found:
        errors.append("no pod runs pshard-server")
    return errors


def check_rendezvous(docs, ctx):
    """What forming the cluster depends on: one coordinator, never two at once, whose Services
    route before readiness; the shard servers run as Indexed Jobs whose every rank runs at once
    (completions = parallelism = the coordinator's world size = the trainers' WORLD_SIZE),
    each server beside its trainer as a native sidecar, named after the completion index (ranks
    follow names) under the Job's own job id, as its trainer's RANK and PSHARD_JOB are; a
    trainer restarted in its pod (OnFailure) finds its rank kept (--trainer-replace-ms)."""
    errors = []
    world = None
    for d, pod in pod_specs(docs):
        for c in containers(pod):
            if binary_of(c) == COORDINATOR:
                if d["kind"] != "Deployment" or d["spec"].get("replicas") != 1:
                    errors.append(f"{name_of(d)}: the coordinator must be one Deployment replica")
                if (d["spec"].get("strategy") or {}).get("type") != "Recreate":
                    errors.append(f"{name_of(d)}: strategy is not Recreate (two coordinators "
                                  f"would overlap during a rollout)")
                env = container_env(docs, d, c)
                world = effective(ctx["bins"][COORDINATOR], "--world-size", c, env)
                nnodes = effective(ctx["bins"][COORDINATOR], "--nnodes", c, env)
                if nnodes:
                    errors.append(f"{name_of(d)}: --nnodes is set; these manifests expect a "
                                  f"fixed --world-size")
    for d in docs:
        if d.get("kind") == "Service" and d["spec"].get("publishNotReadyAddresses") is not True:
            errors.append(f"{name_of(d)}: publishNotReadyAddresses is not true (members "
                          f"starting beside a (re)started pod wait for its readiness probe)")
    jobs = [(d, js) for d, js in job_specs(docs)
            if any(binary_of(c) == SERVER for c in containers(js["template"]))]
    for d, pod in pod_specs(docs):
        if any(binary_of(c) == SERVER for c in containers(pod)) and d["kind"] not in (
                "Job", "JobSet"):
            errors.append(f"{name_of(d)}: shard servers run in the trainers' Job pods, not in a "
                          f"{d['kind']}")
    for d, js in jobs:
        pod = js["template"]
        if js.get("completionMode") != "Indexed":
            errors.append(f"{name_of(d)}: completionMode is not Indexed (RANK is the index)")
        for field in ("completions", "parallelism"):
            if str(js.get(field)) != str(world):
                errors.append(f"{name_of(d)}: {field} {js.get(field)} but the coordinator forms "
                              f"with world size {world}")
        for c in pod["spec"].get("containers") or []:
            if binary_of(c) == SERVER:
                errors.append(f"{name_of(d)} container {c['name']}: the shard server is a main "
                              f"container: the Job would never complete (make it a sidecar)")
        ids = {}
        for c in containers(pod):
            env = container_env(docs, d, c)
            where = f"{name_of(d)} container {c['name']}"
            if binary_of(c) == SERVER:
                name = effective(ctx["bins"][SERVER], "--name", c, env) or ""
                if not name.endswith(f"<fieldRef:{COMPLETION_INDEX}>"):
                    errors.append(f"{where}: the shard server's --name is {name!r}, not named "
                                  f"after the completion index (ranks follow names)")
                ids["server"] = effective(ctx["bins"][SERVER], "--job", c, env)
                replace = effective(ctx["bins"][SERVER], "--trainer-replace-ms", c, env)
                if pod["spec"].get("restartPolicy") == "OnFailure" and str(replace) == "0":
                    errors.append(f"{where}: trainers restart in the pod (OnFailure) but "
                                  f"--trainer-replace-ms is 0, so a restart ends the job")
            elif "PSHARD_SERVER" in env:
                if env.get("WORLD_SIZE") != str(world):
                    errors.append(f"{where}: WORLD_SIZE={env.get('WORLD_SIZE')} but the "
                                  f"coordinator forms with {world}")
                if env.get("RANK") != f"<fieldRef:{COMPLETION_INDEX}>":
                    errors.append(f"{where}: RANK is not the completion index")
                if "PSHARD_COORDINATOR" not in env:
                    errors.append(f"{where}: no PSHARD_COORDINATOR (torch's store)")
                ids["trainer"] = env.get("PSHARD_JOB")
        if ids.get("server") != f"<fieldRef:{JOB_UID}>" or ids.get("trainer") != ids["server"]:
            errors.append(f"{name_of(d)}: the job id is {ids.get('server')!r} (server) and "
                          f"{ids.get('trainer')!r} (trainer), not both the Job's uid")
    if not jobs:
        errors.append("no Job runs pshard-server")
    return errors


def check_labels(docs, ctx):
    """The recommended labels (name, instance, version, component, part-of) on every object and
    every pod template, name and part-of 'pshard', one version throughout."""
    errors = []
    versions = set()

    def need(where, labels):
        labels = labels or {}
        for k in RECOMMENDED_LABELS:
            if not labels.get(k):
                errors.append(f"{where}: no label {k}")
        for k in ("app.kubernetes.io/name", "app.kubernetes.io/part-of"):
            if labels.get(k) not in (None, "pshard"):
                errors.append(f"{where}: {k} is {labels[k]!r}, not 'pshard'")
        if labels.get("app.kubernetes.io/version"):
            versions.add(labels["app.kubernetes.io/version"])

    for d in docs:
        need(name_of(d), d.get("metadata", {}).get("labels"))
        if d.get("kind") == "JobSet":
            for rj in d["spec"].get("replicatedJobs") or []:
                need(f"{name_of(d)} replicatedJob {rj.get('name')}",
                     (rj["template"].get("metadata") or {}).get("labels"))
    for d, pod in pod_specs(docs):
        need(f"{name_of(d)} pod template", (pod.get("metadata") or {}).get("labels"))
    if len(versions) > 1:
        errors.append(f"more than one app.kubernetes.io/version: {sorted(versions)}")
    return errors


# The fields of the custom resources we use, from their API references (JobSet v1alpha2's
# jobset_types.go, Prometheus Operator's PodMonitor v1): field -> None (a value) or the nested
# table. Only what these manifests may set; anything else fails, as strict schemas would.
JOBSET_SPEC = {
    "replicatedJobs": {"name": None, "replicas": None, "template": None, "groupName": None,
                       "dependsOn": None},
    "network": {"enableDNSHostnames": None, "subdomain": None,
                "publishNotReadyAddresses": None},
    "successPolicy": {"operator": None, "targetReplicatedJobs": None},
    "failurePolicy": {"maxRestarts": None, "restartStrategy": None, "rules": None},
    "startupPolicy": {"startupPolicyOrder": None},
    "suspend": None, "coordinator": None, "managedBy": None, "ttlSecondsAfterFinished": None,
    "volumeClaimPolicies": None,
}
PODMONITOR_SPEC = {
    "selector": {"matchLabels": None, "matchExpressions": None},
    "namespaceSelector": {"any": None, "matchNames": None},
    "podMetricsEndpoints": {"port": None, "portNumber": None, "targetPort": None, "path": None,
                            "scheme": None, "interval": None, "scrapeTimeout": None,
                            "honorLabels": None, "relabelings": None,
                            "metricRelabelings": None, "params": None},
    "jobLabel": None, "podTargetLabels": None, "sampleLimit": None, "attachMetadata": None,
}
BUILTIN_GROUPS = {"apps", "batch", "policy", "networking.k8s.io", "rbac.authorization.k8s.io",
                  "autoscaling", "scheduling.k8s.io", "storage.k8s.io"}
CRDS = {("jobset.x-k8s.io/v1alpha2", "JobSet"): JOBSET_SPEC,
        ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_SPEC}


def unknown_fields(value, table, where, errors):
    if table is None:
        return
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            errors.append(f"{where}: {item!r} is not an object")
            continue
        for k, v in item.items():
            if k not in table:
                errors.append(f"{where}: unknown field {k!r}")
            else:
                unknown_fields(v, table[k], f"{where}.{k}", errors)


def check_custom_resources(docs, ctx):
    """Custom resources: only the API versions and fields their references define; a JobSet's
    Jobs are valid batch/v1 Jobs (strict schema), each replicated Job has a name and replicas,
    its success policy is All; a PodMonitor selects pshard pods whose containers have the
    named metrics port, and its path is where the binaries serve metrics."""
    errors = []
    for d in docs:
        api, kind = d.get("apiVersion", ""), d.get("kind")
        if "/" not in api or api.split("/")[0] in BUILTIN_GROUPS:
            continue
        table = CRDS.get((api, kind))
        if table is None:
            errors.append(f"{name_of(d)}: {api} {kind} is none of the custom resources "
                          f"checked here ({sorted(CRDS)})")
            continue
        unknown_fields(d.get("spec") or {}, table, f"{name_of(d)} spec", errors)
        if kind == "JobSet":
            rjs = d["spec"].get("replicatedJobs") or []
            if not rjs:
                errors.append(f"{name_of(d)}: no replicatedJobs")
            if (d["spec"].get("successPolicy") or {}).get("operator") not in (None, "All"):
                errors.append(f"{name_of(d)}: successPolicy is not All (every trainer must "
                              f"finish)")
            for rj in rjs:
                if not rj.get("name") or not isinstance(rj.get("replicas", 1), int):
                    errors.append(f"{name_of(d)}: a replicatedJob without name or replicas")
                job = {"apiVersion": "batch/v1", "kind": "Job",
                       "metadata": dict(rj["template"].get("metadata") or {},
                                        name=f"{d['metadata']['name']}-{rj.get('name')}"),
                       "spec": rj["template"].get("spec")}
                for v in ctx.get("k8s_versions", K8S_VERSIONS):
                    try:
                        kubernetes_validate.validate(job, v, strict=True)
                    except Exception as e:  # ValidationError, or a malformed object
                        msg = str(e).splitlines()[0]
                        errors.append(f"{name_of(d)} replicatedJob {rj.get('name')}: not a "
                                      f"valid batch/v1 Job for Kubernetes {v}: {msg}")
        if kind == "PodMonitor":
            sel = (d["spec"].get("selector") or {}).get("matchLabels") or {}
            eps = d["spec"].get("podMetricsEndpoints") or []
            pods = [pod for w, pod in pod_specs(docs)
                    if w["metadata"].get("namespace") == d["metadata"].get("namespace")
                    and labels_match(sel, (pod.get("metadata") or {}).get("labels"))]
            if not pods:
                errors.append(f"{name_of(d)}: selector {sel} selects no pod template")
            if not eps:
                errors.append(f"{name_of(d)}: no podMetricsEndpoints")
            for ep in eps:
                if ep.get("path", "/metrics") != "/metrics":
                    errors.append(f"{name_of(d)}: path {ep.get('path')!r}; pshard serves "
                                  f"/metrics")
                for pod in pods:
                    ports = {p.get("name") for c in containers(pod)
                             for p in c.get("ports") or []}
                    if ep.get("port") not in ports:
                        errors.append(f"{name_of(d)}: port {ep.get('port')!r} is not a named "
                                      f"container port of every pod it selects")
                        break
    return errors


def check_data_host(docs, ctx):
    """The collectives listen on and publish the pod IP (the default 127.0.0.1 is unreachable
    from other pods, 0.0.0.0 cannot be dialled)."""
    errors = []
    for d, pod in pod_specs(docs):
        for c in containers(pod):
            if binary_of(c) != SERVER:
                continue
            env = container_env(docs, d, c)
            dh = effective(ctx["bins"][SERVER], "--data-host", c, env)
            if dh != "<fieldRef:status.podIP>":
                errors.append(f"{name_of(d)} container {c['name']}: --data-host is {dh!r}, not "
                              f"the pod IP")
    return errors


def port_range(pod):
    for s in (pod["spec"].get("securityContext") or {}).get("sysctls") or []:
        if s.get("name") == "net.ipv4.ip_local_port_range":
            lo, hi = str(s.get("value")).split()
            return int(lo), int(hi)
    return None


def check_network_policy(docs, ctx):
    """Every pshard pod is covered by an Ingress policy; each container port is open to pshard
    pods; nothing else is open except, between shard servers, exactly the port range the
    kernel picks the collectives' listening ports from (the pod's pinned sysctl); peers are
    pshard pods only."""
    errors = []
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    for d, pod in pod_specs(docs):
        ns = d["metadata"].get("namespace")
        labels = pod["metadata"].get("labels") or {}
        mine = [p for p in policies if p["metadata"].get("namespace") == ns and labels_match(
            (p["spec"].get("podSelector") or {}).get("matchLabels"), labels)]
        if not any("Ingress" in (p["spec"].get("policyTypes") or []) for p in mine):
            errors.append(f"{name_of(d)}: no NetworkPolicy restricts its ingress")
            continue
        _, own_ports = container_ports(pod)
        is_server = any(binary_of(c) == SERVER for c in containers(pod))
        data = port_range(pod) if is_server else None
        if is_server and not data:
            errors.append(f"{name_of(d)}: net.ipv4.ip_local_port_range is not pinned, so no "
                          f"policy can name the collectives' ports")
        open_ports, data_open = set(), False
        for p in mine:
            for rule in p["spec"].get("ingress") or []:
                peers = rule.get("from") or []
                if not peers:
                    errors.append(f"{name_of(p)}: a rule allows every source")
                peer_is_server = True
                for peer in peers:
                    if set(peer) != {"podSelector"}:
                        errors.append(f"{name_of(p)}: a peer other than pshard pods: {peer}")
                        peer_is_server = False
                        continue
                    sel = (peer["podSelector"] or {}).get("matchLabels") or {}
                    if sel.get("app.kubernetes.io/name") != "pshard":
                        errors.append(f"{name_of(p)}: a peer that is not a pshard pod: {sel}")
                    if sel.get("app.kubernetes.io/component") != "trainer":
                        peer_is_server = False
                if not rule.get("ports"):
                    errors.append(f"{name_of(p)}: a rule allows every port")
                for pp in rule.get("ports") or []:
                    if pp.get("protocol", "TCP") != "TCP":
                        errors.append(f"{name_of(p)}: protocol {pp.get('protocol')}")
                    port, end = pp.get("port"), pp.get("endPort")
                    if end is None and port in own_ports:
                        open_ports.add(port)
                    elif data and (port, end) == data and peer_is_server:
                        data_open = True
                    else:
                        errors.append(f"{name_of(p)}: opens {port}{'-' + str(end) if end else ''}"
                                      f" to {name_of(d)}, which is not one of its ports"
                                      + (f" nor the data range {data[0]}-{data[1]} between shard "
                                         f"servers" if data else ""))
        for port in sorted(own_ports - open_ports):
            errors.append(f"{name_of(d)}: container port {port} is not open to pshard pods")
        if data and not data_open:
            errors.append(f"{name_of(d)}: the collectives' port range {data[0]}-{data[1]} is not "
                          f"open between shard servers")
    return errors


def check_overlay(docs, ctx):
    """cpu: the tcp backend and no GPU; gpu: one nvidia.com/gpu for each shard server, the
    nccl backend with --offload none or cpu, a CUDA image; the coordinator never asks for a
    GPU."""
    errors = []
    overlay = ctx["overlay"]
    for d, pod in pod_specs(docs):
        for c in containers(pod):
            which = binary_of(c)
            res = c.get("resources") or {}
            gpus = (res.get("limits") or {}).get("nvidia.com/gpu")
            where = f"{name_of(d)} container {c['name']}"
            if which == SERVER:
                backend = effective(ctx["bins"][SERVER], "--backend", c,
                                    container_env(docs, d, c))
                if overlay == "gpu":
                    if str(gpus) != "1":
                        errors.append(f"{where}: nvidia.com/gpu limit is {gpus}, expected 1")
                    if backend != "nccl":
                        errors.append(f"{where}: backend {backend!r}, expected nccl")
                    # pshard-server refuses any other placement, so the pod would crash-loop.
                    offload = effective(ctx["bins"][SERVER], "--offload", c,
                                        container_env(docs, d, c))
                    if offload not in ("none", "cpu"):
                        errors.append(f"{where}: offload {offload!r}, expected none (GPU "
                                      "memory) or cpu")
                    if "cuda" not in c.get("image", ""):
                        errors.append(f"{where}: image {c.get('image')!r} is not the CUDA image")
                else:
                    if gpus is not None:
                        errors.append(f"{where}: asks for nvidia.com/gpu on the cpu overlay")
                    if backend != "tcp":
                        errors.append(f"{where}: backend {backend!r}, expected tcp")
            elif gpus is not None and (overlay != "gpu" or which == COORDINATOR):
                errors.append(f"{where}: asks for nvidia.com/gpu")
    return errors


CHECKS = [
    ("selectors", check_selectors),
    ("probes", check_probes),
    ("addresses", check_addresses),
    ("references", check_references),
    ("environment", check_environment),
    ("security", check_security),
    ("resources", check_resources),
    ("shm", check_shm),
    ("rendezvous", check_rendezvous),
    ("data-host", check_data_host),
    ("network-policy", check_network_policy),
    ("labels", check_labels),
    ("custom-resources", check_custom_resources),
    ("overlay", check_overlay),
]


def run_checks(docs, ctx, quiet=False):
    """Runs every check; returns {check name: [errors]}."""
    results = {}
    for name, fn in CHECKS:
        errs = fn(docs, ctx)
        results[name] = errs
        if not quiet:
            if errs:
                print(f"FAIL {name}")
                for e in errs:
                    print(f"     {e}")
            else:
                print(f"ok   {name}")
    return results


# ---------------------------------------------------------------------------------------------
# Self-test: one way to break the manifests per check.


def obj(docs, kind, name_prefix):
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"].startswith(name_prefix):
            return d
    raise KeyError(f"{kind}/{name_prefix}*")


def ctr(docs, kind, name, container):
    """A container (main or native sidecar) of the first pod template of kind/name*."""
    d = obj(docs, kind, name)
    pod = next(p for w, p in pod_specs([d]))
    return next(c for c in containers(pod) if c["name"] == container)


def trainer_pod(docs):
    """The trainers' pod template (the Job's, or the JobSet's Job's)."""
    return next(p for w, p in pod_specs(docs) if w["kind"] in ("Job", "JobSet"))


def trainer_job(docs):
    return next(js for w, js in job_specs(docs))


def tctr(docs, container):
    return next(c for c in containers(trainer_pod(docs)) if c["name"] == container)


def env_set(c, name, value):
    c["env"] = [e for e in c.get("env") or [] if e["name"] != name] + [
        {"name": name, "value": value}]


def drop_run_as_non_root(pod):
    spec = pod["spec"]
    spec["securityContext"].pop("runAsNonRoot", None)
    for c in (spec.get("initContainers") or []) + spec["containers"]:
        (c.get("securityContext") or {}).pop("runAsNonRoot", None)


def sidecar_to_main(docs):
    spec = trainer_pod(docs)["spec"]
    server = next(c for c in spec["initContainers"] if c["name"] == "shard-server")
    spec["initContainers"].remove(server)
    server.pop("restartPolicy")
    spec["containers"].append(server)


def mutations(overlay):
    """(check expected to fail, what is broken, function that breaks a copy of the docs)."""
    dep = ("Deployment", "pshard-coordinator")
    crd = "JobSet" if overlay == "jobset" else "Job"
    m = [
        ("selectors", "coordinator template label differs from its selector",
         lambda D: obj(D, *dep)["spec"]["template"]["metadata"]["labels"].update(
             {"app.kubernetes.io/component": "coord"})),
        ("selectors", "coordinator Service selects nothing",
         lambda D: obj(D, "Service", "pshard-coordinator")["spec"]["selector"].update(
             {"app.kubernetes.io/component": "coord"})),
        ("selectors", "Service targetPort names no container port",
         lambda D: obj(D, "Service", "pshard-coordinator")["spec"]["ports"][0].update(
             {"targetPort": "grcp"})),
        ("selectors", "PodDisruptionBudget selects nothing",
         lambda D: obj(D, "PodDisruptionBudget", "pshard-trainer")["spec"]["selector"][
             "matchLabels"].update({"app.kubernetes.io/name": "pshard-x"})),
        ("probes", "coordinator readiness probe on another port",
         lambda D: ctr(D, *dep, "coordinator")["readinessProbe"]["grpc"].update({"port": 29501})),
        ("probes", "readiness on a health service the binary does not serve",
         lambda D: ctr(D, *dep, "coordinator")["readinessProbe"]["grpc"].update(
             {"service": "pshard.Formed"})),
        ("probes", "liveness gated on the cluster",
         lambda D: tctr(D, "shard-server")["livenessProbe"]["grpc"].update(
             {"service": "pshard.ShardServer"})),
        ("probes", "shard server left on its default listen address (127.0.0.1:0)",
         lambda D: tctr(D, "shard-server").update(
             {"env": [e for e in tctr(D, "shard-server")["env"]
                      if e["name"] != "PSHARD_SERVER_LISTEN"]})),
        ("probes", "coordinator listens on another port than its probes",
         lambda D: env_set(ctr(D, *dep, "coordinator"), "PSHARD_LISTEN", "0.0.0.0:29501")),
        ("addresses", "trainer dials a shard server on another port",
         lambda D: env_set(tctr(D, "trainer"), "PSHARD_SERVER", "127.0.0.1:29601")),
        ("addresses", "PSHARD_COORDINATOR names no Service",
         lambda D: obj(D, "ConfigMap", "pshard-config")["data"].update(
             {"PSHARD_COORDINATOR": "coordinator:29500"})),
        ("references", "Secret volume names a Secret that does not exist",
         lambda D: next(v for v in trainer_pod(D)["spec"]["volumes"]
                        if "secret" in v)["secret"].update({"secretName": "pshard-secret"})),
        ("references", "envFrom names a ConfigMap that does not exist",
         lambda D: tctr(D, "shard-server")["envFrom"][0]["configMapRef"].update(
             {"name": "pshard-conf"})),
        ("references", "token file outside every mounted Secret",
         lambda D: env_set(tctr(D, "trainer"), "PSHARD_TOKEN_FILE", "/etc/pshard/token")),
        ("environment", "shard server's metrics variable misspelt",
         lambda D: env_set(tctr(D, "shard-server"), "PSHARD_METRIC_LISTEN", "0.0.0.0:9464")),
        ("environment", "trainer given a variable only the shard server reads",
         lambda D: env_set(tctr(D, "trainer"), "PSHARD_DATA_HOST", "127.0.0.1")),
        ("environment", "ConfigMap key no program reads",
         lambda D: obj(D, "ConfigMap", "pshard-config")["data"].update(
             {"PSHARD_BAKCEND": "tcp"})),
        ("security", "writable root filesystem",
         lambda D: tctr(D, "trainer")["securityContext"].update(
             {"readOnlyRootFilesystem": False})),
        ("security", "sidecar's capabilities not dropped",
         lambda D: tctr(D, "shard-server")["securityContext"].pop("capabilities")),
        ("security", "runAsNonRoot removed", lambda D: drop_run_as_non_root(trainer_pod(D))),
        ("security", "command replaces tini",
         lambda D: ctr(D, *dep, "coordinator").update({"command": ["pshard-coordinator"]})),
        ("security", "trainers outside the restricted namespace",
         lambda D: obj(D, crd, "pshard-train")["metadata"].pop("namespace")),
        ("resources", "no memory limit",
         lambda D: tctr(D, "trainer")["resources"]["limits"].pop("memory")),
        ("resources", "request above limit",
         lambda D: ctr(D, *dep, "coordinator")["resources"]["requests"].update({"cpu": "2"})),
        ("shm", "trainer without /dev/shm",
         lambda D: tctr(D, "trainer").update(
             {"volumeMounts": [m for m in tctr(D, "trainer")["volumeMounts"]
                               if m["mountPath"] != "/dev/shm"]})),
        ("shm", "/dev/shm on disk, not memory",
         lambda D: next(v for v in trainer_pod(D)["spec"]["volumes"]
                        if v["name"] == "dshm")["emptyDir"].pop("medium")),
        ("rendezvous", "parallelism differs from the world size",
         lambda D: trainer_job(D).update({"parallelism": 3})),
        ("rendezvous", "not an Indexed Job",
         lambda D: trainer_job(D).pop("completionMode")),
        ("rendezvous", "shard server as a main container (the Job never completes)",
         sidecar_to_main),
        ("rendezvous", "coordinator Service routes only to ready pods",
         lambda D: obj(D, "Service", "pshard-coordinator")["spec"].update(
             {"publishNotReadyAddresses": False})),
        ("rendezvous", "two coordinators",
         lambda D: obj(D, *dep)["spec"].update({"replicas": 2})),
        ("rendezvous", "trainer RANK fixed",
         lambda D: env_set(tctr(D, "trainer"), "RANK", "0")),
        ("rendezvous", "server named after the pod, not the index",
         lambda D: env_set(tctr(D, "shard-server"), "PSHARD_NAME", "trainer")),
        ("rendezvous", "trainer and server in different coordinator jobs",
         lambda D: env_set(tctr(D, "trainer"), "PSHARD_JOB", "train")),
        ("rendezvous", "trainer restarts in the pod but the server drops its rank",
         lambda D: env_set(tctr(D, "shard-server"), "PSHARD_TRAINER_REPLACE_MS", "0")),
        ("data-host", "collectives on 0.0.0.0",
         lambda D: env_set(tctr(D, "shard-server"), "PSHARD_DATA_HOST", "0.0.0.0")),
        ("network-policy", "data range differs from the pinned sysctl",
         lambda D: obj(D, "NetworkPolicy", "pshard-trainer")["spec"]["ingress"][1]["ports"][
             0].update({"endPort": 40000})),
        ("network-policy", "an extra port (22) opened",
         lambda D: obj(D, "NetworkPolicy", "pshard-coordinator")["spec"]["ingress"][0][
             "ports"].append({"protocol": "TCP", "port": 22})),
        ("network-policy", "shard server gRPC port not open",
         lambda D: obj(D, "NetworkPolicy", "pshard-trainer")["spec"]["ingress"].pop(0)),
        ("network-policy", "open to any source",
         lambda D: obj(D, "NetworkPolicy", "pshard-coordinator")["spec"]["ingress"][0].pop(
             "from")),
        ("network-policy", "sysctl not pinned",
         lambda D: trainer_pod(D)["spec"]["securityContext"].pop("sysctls")),
        ("labels", "no version label on the trainers' pods",
         lambda D: trainer_pod(D)["metadata"]["labels"].pop("app.kubernetes.io/version")),
        ("labels", "no instance label on a Secret",
         lambda D: obj(D, "Secret", "pshard-secrets")["metadata"]["labels"].pop(
             "app.kubernetes.io/instance")),
        ("labels", "two versions",
         lambda D: obj(D, *dep)["metadata"]["labels"].update(
             {"app.kubernetes.io/version": "0.2.0"})),
        ("custom-resources", "PodMonitor scrapes a port no pod names",
         lambda D: obj(D, "PodMonitor", "pshard")["spec"]["podMetricsEndpoints"][0].update(
             {"port": "http-metrics"})),
        ("custom-resources", "PodMonitor field misspelt",
         lambda D: obj(D, "PodMonitor", "pshard")["spec"].update(
             {"podMetricEndpoints": []})),
        ("custom-resources", "PodMonitor selects nothing",
         lambda D: obj(D, "PodMonitor", "pshard")["spec"]["selector"]["matchLabels"].update(
             {"app.kubernetes.io/name": "pshard-x"})),
    ]
    if overlay == "jobset":
        m += [
            ("custom-resources", "JobSet field misspelt",
             lambda D: obj(D, "JobSet", "pshard-train")["spec"]["failurePolicy"].update(
                 {"maxRestart": 2})),
            ("custom-resources", "JobSet's Job not a valid Job (completionMode typo)",
             lambda D: trainer_job(D).update({"completionmode": "Indexed"})),
            ("custom-resources", "JobSet of another API version",
             lambda D: obj(D, "JobSet", "pshard-train").update(
                 {"apiVersion": "jobset.x-k8s.io/v1alpha1"})),
            ("custom-resources", "JobSet succeeds when any Job does",
             lambda D: obj(D, "JobSet", "pshard-train")["spec"]["successPolicy"].update(
                 {"operator": "Any"})),
            ("references", "JobSet names the ConfigMap without its generated suffix",
             lambda D: tctr(D, "trainer")["envFrom"][0]["configMapRef"].update(
                 {"name": "pshard-config"})),
        ]
    if overlay == "gpu":
        m += [
            ("overlay", "gpu overlay without nvidia.com/gpu",
             lambda D: tctr(D, "shard-server")["resources"]["limits"].pop("nvidia.com/gpu")),
            ("overlay", "gpu overlay on the tcp backend",
             lambda D: obj(D, "ConfigMap", "pshard-config")["data"].update(
                 {"PSHARD_BACKEND": "tcp"})),
            ("overlay", "gpu overlay with an offload pshard-server refuses",
             lambda D: obj(D, "ConfigMap", "pshard-config")["data"].update(
                 {"PSHARD_OFFLOAD": "gpu"})),
        ]
    else:
        m += [
            ("overlay", "cpu overlay asks for a GPU",
             lambda D: tctr(D, "shard-server")["resources"].setdefault("limits", {}).update(
                 {"nvidia.com/gpu": 1})),
        ]
    return m


def self_test(files, ctx):
    failures = 0
    for path, overlay in zip(files, OVERLAYS):
        docs = load(path)
        ctx = dict(ctx, overlay=overlay)
        base = run_checks(docs, ctx, quiet=True)
        if any(base.values()):
            print(f"FAIL {overlay}: the unbroken manifests do not pass:")
            run_checks(docs, ctx)
            return 1
        for check, what, breaker in mutations(overlay):
            broken = copy.deepcopy(docs)
            breaker(broken)
            try:
                res = run_checks(broken, ctx, quiet=True)
            except Exception as e:  # a check must report, not crash
                print(f"FAIL {overlay}: '{what}' crashed the checks: {e!r}")
                failures += 1
                continue
            if res[check]:
                print(f"ok   {overlay}: '{what}' caught by {check}: {res[check][0]}")
            else:
                print(f"FAIL {overlay}: '{what}' not caught by {check}")
                failures += 1
    return 1 if failures else 0


def load(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    if not docs:
        raise SystemExit(f"check_manifests: {path} holds no objects")
    return docs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--overlay", choices=OVERLAYS)
    ap.add_argument("--coordinator-bin", required=True)
    ap.add_argument("--server-bin", required=True)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    ctx = {"bins": {COORDINATOR: Binary(a.coordinator_bin), SERVER: Binary(a.server_bin)}}
    if a.self_test:
        if len(a.files) != len(OVERLAYS):
            ap.error(f"--self-test takes the rendered overlays {', '.join(OVERLAYS)}")
        return self_test(a.files, ctx)
    if not a.overlay or len(a.files) != 1:
        ap.error("give --overlay and one rendered file")
    ctx["overlay"] = a.overlay
    results = run_checks(load(a.files[0]), ctx)
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
