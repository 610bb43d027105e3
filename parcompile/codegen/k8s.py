"""Kubernetes manifests for a compiled plan: what ``parcompile compile -o DIR`` writes into ``DIR/k8s/``.

The manifests are built as plain Python data and rendered with PyYAML (:func:`render`: sorted keys,
block style, byte-stable). One file per object kind:

- ``configmap.yaml``: the files the pods need (plan.json, the program; for single-node serving also
  the spec, which ``parcompile serve`` compiles), split over several ConfigMaps when they exceed the
  API server's 1 MiB per object (kubernetes ``pkg/apis/core/validation/validation.go``
  ``ValidateConfigMap``: the values' bytes may not exceed ``core.MaxSecretSize``, 1 MiB); a file
  larger than that is cut into parts that the pod's init container joins.
- training: ``jobset.yaml``, a JobSet (``jobset.x-k8s.io/v1alpha2``) of one replicated job of
  ``nodes`` pods with ``gpus_per_node`` devices each. Every pod runs the torchrun line of launch.sh;
  the rendezvous host is the first pod, ``<jobset>-<replicated job>-0-0.<subdomain>`` through the
  JobSet's headless service (``network.subdomain``), and a pod's node rank is its Job completion
  index, read from the annotation ``batch.kubernetes.io/job-completion-index``: as
  kubernetes-sigs/jobset's own PyTorch example does (``examples/pytorch/cnn-mnist/mnist.yaml`` at
  17425992a33e61b13c1cf67cea4ab6a2e074049a: ``MASTER_ADDR`` ``pytorch-workers-0-0.pytorch``, the
  rank from that annotation through the downward API).
- serving on one node: ``deployment.yaml`` and ``service.yaml``, ``parcompile serve`` as the
  container's command (the OpenAI-compatible server, ``GET /health`` its readiness probe).
- serving on several nodes: ``leaderworkerset.yaml``, a LeaderWorkerSet
  (``leaderworkerset.x-k8s.io/v1``) whose group of ``nodes`` pods runs launch.sh's torchrun line of
  the serve program, the rendezvous at the leader: ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX``,
  the variables LWS adds to every container (kubernetes-sigs/lws
  ``api/leaderworkerset/v1/leaderworkerset_types.go``). ``parcompile serve``'s HTTP front runs on
  one node only; a multi-node endpoint is vLLM's or SGLang's (``parcompile export``).

Every pod copies the ConfigMap's files into its workspace (``/workspace``: an ``emptyDir``, or the
PersistentVolumeClaim ``storage`` names) and runs there, so that the program's directory is writable
(metrics.jsonl, checkpoints) and the spec's relative paths resolve inside the workspace as they did
beside the compiled program: the files are placed as deep in the workspace as those paths climb
(:func:`workspace_layout`), and each manifest's header lists where the spec's files are in the pods. The pods' environment is the launchers' (the accelerator's
``launch_env``, :data:`parcompile.config.presets.ACCELERATORS`) and, for training, the caching
allocator's mode (:func:`parcompile.codegen.emit.allocator_env`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from parcompile.codegen.emit import allocator_env, comment_text, program_name, program_paths
from parcompile.config.schema import SpecConfig
from parcompile.core.version import version

#: where the ConfigMap's files are mounted (read-only) and where the pods run (writable)
FILES_MOUNT = "/etc/parcompile"
WORKSPACE = "/workspace"
#: where a single-node serving pod compiles its spec (``parcompile serve -o``): a directory of its
#: own, apart from the spec's files in the workspace (a ``weights = "build/ckpt"`` stays the user's)
SERVE_BUILD = "/workspace/parcompile-serve"
#: launch.sh's rendezvous port (``MASTER_PORT`` unless set) and ``parcompile serve``'s default port
MASTER_PORT = 29500
SERVE_PORT = 8000
#: ``core.MaxSecretSize``: the most bytes of values one ConfigMap may hold (see module docstring)
CONFIGMAP_MAX_BYTES = 1 << 20
#: the replicated job of the JobSet (pods ``<jobset>-node-0-<i>``)
REPLICATED_JOB = "node"
#: the longest suffix a derived object or pod name adds to the plan's name
#: (``-node-0-<index>``, ``-files-<n>``): names stay within a DNS label's 63 characters
_NAME_BUDGET = 40

#: RFC 1123 label (namespaces) and RFC 1035 label (Service, JobSet and LWS names: they become
#: Service names and host names), as k8s.io/apimachinery/pkg/util/validation/validation.go spells them
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
#: an image reference, distribution/reference's grammar (regexp.go: domain, path components, tag, digest)
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
#: the whole reference, ASCII only (Go's ``\w`` is ``[0-9A-Za-z_]``; Python's takes any letter)
_IMAGE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
                    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?\Z", re.ASCII)
#: ConfigMap keys (k8s.io/apimachinery validation.IsConfigMapKey: this, at most 253 characters,
#: not starting with "..")
_CONFIGMAP_KEY = re.compile(r"(?!\.\.)[-._a-zA-Z0-9]{1,253}\Z")


class K8sError(ValueError):
    """A Kubernetes option (image, namespace, storage) the API server would refuse; the message is
    one line that names the option, the value and what a valid one looks like."""


@dataclass(frozen=True)
class K8sOptions:
    """Where and how the manifests run: ``compile``'s ``--image``, ``--namespace`` and ``--storage``.

    Attributes:
        image: the container image every pod runs: it must hold torch and this parcompile
            (default ``parcompile:<version>``, an image you build and push).
        namespace: the namespace of every object (an RFC 1123 label; None: ``default``).
        storage: a PersistentVolumeClaim mounted as the pods' workspace (checkpoints, metrics and
            the spec's data live there); None: an ``emptyDir``, gone with the pod.
    """

    image: str | None = None
    namespace: str | None = "default"
    storage: str | None = None

    def checked(self) -> "K8sOptions":
        """These options with the default image filled in.

        Raises:
            K8sError: a value the API server would refuse (a namespace with spaces, an image
                reference with quotes, ...)."""
        image = self.image if self.image is not None else f"parcompile:{_image_tag(version())}"
        if len(image) > 255 or not _IMAGE.match(image):
            raise K8sError(f"--image {_shown(image)} is not an image reference "
                           "([registry/]name[:tag][@digest], lowercase name, no spaces or quotes)")
        ns = self.namespace if self.namespace is not None else "default"
        if len(ns) > 63 or not _DNS1123_LABEL.match(ns):
            raise K8sError(f"--namespace {_shown(ns)} is not a Kubernetes namespace name (at most 63 characters: "
                           "lowercase letters, digits and '-', starting and ending with a letter or digit)")
        if self.storage is not None and (len(self.storage) > 253 or not _DNS1123_SUBDOMAIN.match(self.storage)):
            raise K8sError(f"--storage {_shown(self.storage)} is not a PersistentVolumeClaim name (at most 253 "
                           "characters: lowercase letters, digits, '-' and '.')")
        return K8sOptions(image=image, namespace=ns, storage=self.storage)


def _image_tag(text: str) -> str:
    """A version as an image tag (``+`` of a local version is not allowed in tags)."""
    return re.sub(r"[^\w.-]", "-", text)[:128] or "latest"


def _shown(value: str) -> str:
    """``value`` quoted for a one-line message (control characters escaped)."""
    return repr(value) if len(value) <= 80 else repr(value[:77]) + "..."


def object_name(spec_name: str) -> str:
    """The objects' name derived from the spec's name: an RFC 1035 label (a Service's name and a
    pod's host name are built from it) of at most 40 characters, so that ``-node-0-<index>`` and
    the like still fit 63. Lowercased, every other character run a ``-``, a leading digit
    prefixed by ``p-``; a longer name is cut and given 6 hex digits of its SHA-1, so that two long
    names that share their start stay apart. ``llama3_8b`` -> ``llama3-8b``."""
    base = re.sub(r"[^a-z0-9]+", "-", spec_name.lower()).strip("-") or "parcompile"
    if not base[0].isalpha():
        base = "p-" + base
    if len(base) <= _NAME_BUDGET:
        return base
    digest = hashlib.sha1(spec_name.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    return f"{base[:_NAME_BUDGET - 7].rstrip('-')}-{digest}"


# -- the workspace ------------------------------------------------------------------------


def _climb(path: str) -> int:
    """How many directories a relative path climbs before it descends (its leading ``..``)."""
    n = 0
    for part in os.path.normpath(path).split(os.sep):
        if part != "..":
            break
        n += 1
    return n


def _mirrored(directory: str | os.PathLike, paths: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Where ``directory`` sits in the pods' workspace so that ``paths`` (key -> a path relative
    to it, or absolute) land inside :data:`WORKSPACE` as they lie beside it on this machine: the
    last ``n`` of its real directories under the workspace, ``n`` the most any relative path
    climbs (``out/run1`` with ``../../data/train.jsonl``: ``/workspace/out/run1`` and
    ``/workspace/data/train.jsonl``). Returns (that directory, key -> the path in the pods;
    an absolute path as it is)."""
    rel = {k: v for k, v in paths.items() if not os.path.isabs(v)}
    parts = [p for p in os.path.realpath(directory).split(os.sep) if p]
    n = min(max(map(_climb, rel.values()), default=0), len(parts))
    here = posixpath.join(WORKSPACE, *parts[len(parts) - n:])
    return here, {k: (posixpath.normpath(posixpath.join(here, *v.split(os.sep))) if k in rel else v)
                  for k, v in paths.items()}


def workspace_layout(cfg: SpecConfig, out_dir: str | os.PathLike | None) -> tuple[str, str, dict[str, str]]:
    """The pods' directories and files: (the program's directory, the spec's directory, key ->
    the path in the pods of each file the program or the spec names), so that every relative
    path resolves inside :data:`WORKSPACE` (the volume ``--storage`` names) as it did beside the
    compiled program (:func:`_mirrored` of the program's paths,
    :func:`parcompile.codegen.emit.program_paths`) and, for single-node serving, whose pod
    compiles the spec, beside the spec (the spec's own paths, relative to its directory).
    ``out_dir`` None (a plan not written to a directory): the workspace itself."""
    if out_dir is None:
        return WORKSPACE, WORKSPACE, {}
    program_dir, where = _mirrored(out_dir, program_paths(cfg, out_dir))
    spec_dir = WORKSPACE
    if cfg.workload == "serve" and cfg.cluster.nodes == 1:
        home = os.path.dirname(os.path.abspath(cfg.filename))
        spec_dir, where = _mirrored(home, program_paths(cfg, home))
    return program_dir, spec_dir, where


# -- the ConfigMap ------------------------------------------------------------------------


def _parts(name: str, text: str) -> list[tuple[str, str]]:
    """``text`` as ConfigMap values of at most :data:`CONFIGMAP_MAX_BYTES` bytes, cut on UTF-8
    character boundaries: ``[(name, text)]`` when it fits, else ``name.part-000``, ``-001``, ..."""
    data = text.encode("utf-8")
    if len(data) <= CONFIGMAP_MAX_BYTES:
        return [(name, text)]
    out, start = [], 0
    while start < len(data):
        end = min(start + CONFIGMAP_MAX_BYTES, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:   # not inside a character
            end -= 1
        out.append((f"{name}.part-{len(out):03d}", data[start:end].decode("utf-8")))
        start = end
    return out


def _configmaps(name: str, meta: dict, files: dict[str, str], dirs: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The ConfigMaps holding ``files`` (name -> text), packed in order so that each holds at most
    1 MiB of values, and the shell lines that rebuild the files from the mount, each in its
    directory of the workspace (``dirs``: name -> directory, :func:`workspace_layout`)."""
    packs: list[dict[str, str]] = [{}]
    size = 0
    lines = [f"mkdir -p {shlex.quote(d)}" for d in sorted(set(dirs.values())) if d != WORKSPACE]
    for fname, text in files.items():
        parts = _parts(fname, text)
        for key, value in parts:
            n = len(value.encode("utf-8"))
            if packs[-1] and size + n > CONFIGMAP_MAX_BYTES:
                packs.append({})
                size = 0
            packs[-1][key] = value
            size += n
        sources = " ".join(shlex.quote(f"{FILES_MOUNT}/{k}") for k, _ in parts)
        lines.append(f"cat {sources} > {shlex.quote(f'{dirs[fname]}/{fname}')}")
    maps = []
    for i, data in enumerate(packs):
        maps.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {**meta, "name": _configmap_name(name, i)}, "data": data})
    return maps, lines


def _configmap_name(name: str, index: int) -> str:
    return f"{name}-files" if index == 0 else f"{name}-files-{index}"


# -- the pod -------------------------------------------------------------------------------


def _env(pairs) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in pairs]


def _pod_spec(cfg: SpecConfig, opts: K8sOptions, name: str, configmaps: list[dict], copy: list[str],
              container: dict, workdir: str = WORKSPACE) -> dict:
    """The pod: an init container that copies the ConfigMaps' files into the workspace, then
    ``container`` (its name, command, ports, env, probes) with the image, the devices, its
    working directory ``workdir`` (in the workspace: the program's) and the accelerator's
    environment."""
    acc = cfg.cluster.accelerator
    if len(configmaps) == 1:
        files = {"name": "files", "configMap": {"name": configmaps[0]["metadata"]["name"]}}
    else:
        files = {"name": "files", "projected": {"sources": [
            {"configMap": {"name": m["metadata"]["name"]}} for m in configmaps]}}
    workspace = ({"name": "workspace", "persistentVolumeClaim": {"claimName": opts.storage}} if opts.storage
                 else {"name": "workspace", "emptyDir": {}})
    mounts = [{"name": "workspace", "mountPath": WORKSPACE}]
    main = {"image": opts.image, "workingDir": workdir, "volumeMounts": mounts, **container}
    env = [("PYTHONUNBUFFERED", "1")] + [(var, value) for var, value, _why in acc.launch_env]
    main["env"] = container.get("env", []) + _env(env)
    if acc.k8s_resource:
        main["resources"] = {"limits": {acc.k8s_resource: str(cfg.cluster.gpus_per_node)}}   # a Quantity
    init = {"name": "files", "image": opts.image, "command": ["sh", "-c", "set -e\n" + "\n".join(copy)],
            "volumeMounts": mounts + [{"name": "files", "mountPath": FILES_MOUNT, "readOnly": True}]}
    return {"initContainers": [init], "containers": [main], "volumes": [files, workspace]}


def torchrun_args(cfg: SpecConfig, node_rank: str, master_addr: str, workdir: str = WORKSPACE) -> list[str]:
    """launch.sh's torchrun line as a container's argv, Kubernetes' ``$(VAR)`` references for the
    node rank and the rendezvous host (one node: ``--standalone``, as launch.sh), the program in
    ``workdir`` (:func:`workspace_layout`)."""
    c = cfg.cluster
    program = f"{workdir}/{program_name(cfg)}"
    if c.nodes == 1:
        return ["torchrun", "--standalone", "--nproc-per-node", str(c.gpus_per_node), program]
    return ["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.gpus_per_node),
            "--node-rank", node_rank, "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{master_addr}:$(MASTER_PORT)", program]


def _jobset(cfg: SpecConfig, name: str, meta: dict, pod: dict) -> dict:
    """The training JobSet: one replicated job, ``nodes`` indexed pods (see module docstring)."""
    nodes = cfg.cluster.nodes
    pod = {**pod, "restartPolicy": "Never"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {**meta, "name": name},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": {
                "parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
                "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod}}}}],
        },
    }


def _train_container(cfg: SpecConfig, name: str, workdir: str) -> dict:
    env = allocator_env(cfg)
    rank_env = []
    if cfg.cluster.nodes > 1:
        rank_env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                    {"name": "MASTER_ADDR", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"},
                    {"name": "MASTER_PORT", "value": str(MASTER_PORT)}]
    return {"name": "trainer", "command": torchrun_args(cfg, "$(NODE_RANK)", "$(MASTER_ADDR)", workdir),
            **({"ports": [{"containerPort": MASTER_PORT, "name": "rendezvous"}]} if cfg.cluster.nodes > 1 else {}),
            "env": rank_env + _env(env)}


def _spec_key(cfg: SpecConfig) -> str:
    """The spec's file name as a ConfigMap key (``spec.par`` where the name is not a valid key)."""
    fname = Path(cfg.filename).name
    return fname if _CONFIGMAP_KEY.match(fname) and fname not in (".", "plan.json", "serve.py") else "spec.par"


def _serve_single(cfg: SpecConfig, name: str, meta: dict, pod: dict) -> dict[str, dict]:
    """One node: a Deployment running ``parcompile serve`` and a ClusterIP Service in front."""
    selector = {"app.kubernetes.io/name": name}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                 "strategy": {"type": "Recreate"},   # the devices of one replica at a time
                 "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": name},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": SERVE_PORT, "targetPort": "http"}]},
    }
    return {"deployment.yaml": deployment, "service.yaml": service}


def _serve_container(cfg: SpecConfig, workdir: str, spec_dir: str) -> dict:
    if cfg.cluster.nodes == 1:
        command = ["parcompile", "serve", f"{spec_dir}/{_spec_key(cfg)}", "-o", SERVE_BUILD,
                   "--host", "0.0.0.0", "--port", str(SERVE_PORT)]
        probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10}
        return {"name": "server", "command": command, "ports": [{"containerPort": SERVE_PORT, "name": "http"}],
                "readinessProbe": probe}
    return {"name": "server", "command": torchrun_args(cfg, "$(LWS_WORKER_INDEX)", "$(LWS_LEADER_ADDRESS)", workdir),
            "ports": [{"containerPort": MASTER_PORT, "name": "rendezvous"}],
            "env": [{"name": "MASTER_PORT", "value": str(MASTER_PORT)}]}


def _leaderworkerset(cfg: SpecConfig, name: str, meta: dict, pod: dict) -> dict:
    """Several nodes: one LeaderWorkerSet group of ``nodes`` pods (the leader is worker 0)."""
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {**meta, "name": name},
        "spec": {"replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": {
            "size": cfg.cluster.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
            "workerTemplate": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod}}},
    }


def manifests(cfg: SpecConfig, files: dict[str, str], options: K8sOptions | None = None,
              spec_text: str | None = None, out_dir: str | os.PathLike | None = None) -> dict[str, dict | list]:
    """The plan's Kubernetes objects by file name (``jobset.yaml`` or ``deployment.yaml`` +
    ``service.yaml`` or ``leaderworkerset.yaml``, and ``configmap.yaml``: a list of ConfigMaps),
    as plain data. ``files`` are compile's outputs (name -> text): plan.json and the program are
    taken from them; ``spec_text`` is the spec, which single-node serving compiles in the pod;
    ``out_dir`` the directory they are written to (where the pods place them:
    :func:`workspace_layout`).

    Raises:
        K8sError: an option the API server would refuse (:meth:`K8sOptions.checked`); a serve
            plan on one node whose spec text is not given."""
    opts = (options or K8sOptions()).checked()
    name = object_name(cfg.name)
    meta = {"namespace": opts.namespace, "labels": {"app.kubernetes.io/name": name,
                                                    "app.kubernetes.io/managed-by": "parcompile"}}
    program = program_name(cfg)
    workdir, spec_dir, _where = workspace_layout(cfg, out_dir)
    carried = {"plan.json": files["plan.json"], program: files[program]}
    dirs = {"plan.json": workdir, program: workdir}
    if cfg.workload == "serve" and cfg.cluster.nodes == 1:
        if spec_text is None:
            raise K8sError("the Deployment runs `parcompile serve` on the spec: its text is needed (compile from text)")
        carried[_spec_key(cfg)] = spec_text
        dirs = {fname: spec_dir for fname in carried}   # the pod compiles the spec (SERVE_BUILD)
    configmaps, copy = _configmaps(name, meta, carried, dirs)
    if cfg.workload == "train":
        pod = _pod_spec(cfg, opts, name, configmaps, copy, _train_container(cfg, name, workdir), workdir)
        out: dict[str, Any] = {"jobset.yaml": _jobset(cfg, name, meta, pod)}
    else:
        pod = _pod_spec(cfg, opts, name, configmaps, copy, _serve_container(cfg, workdir, spec_dir),
                        spec_dir if cfg.cluster.nodes == 1 else workdir)
        out = (_serve_single(cfg, name, meta, pod) if cfg.cluster.nodes == 1
               else {"leaderworkerset.yaml": _leaderworkerset(cfg, name, meta, pod)})
    out["configmap.yaml"] = configmaps
    return out


# -- rendering ----------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper with multi-line strings as literal blocks (a script reads as written)
    and no anchors: an object shared between two places is written out in both."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    # a literal block only where "\n" is the one line break: YAML also breaks lines at \r, NEL
    # (U+0085), U+2028 and U+2029, which a block would turn into "\n" (quoted, they are escaped)
    style = "|" if "\n" in value and not any(ch in value for ch in "\r\t\x85\u2028\u2029") \
        and value == value.rstrip(" ") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(objects: dict | list) -> str:
    """One object, or a list of them as a multi-document stream, as YAML text: sorted keys, block
    style, unicode kept; the same objects give the same bytes."""
    docs = objects if isinstance(objects, list) else [objects]
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=True, default_flow_style=False, allow_unicode=True,
                         width=120, explicit_start=True)


def k8s_files(cfg: SpecConfig, files: dict[str, str], options: K8sOptions | None = None,
              spec_text: str | None = None, out_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """``k8s/<file>`` -> YAML text for every manifest of :func:`manifests` (what ``compile``
    writes, with the other outputs, in one atomic step). None for a serve plan on one node whose
    spec text is unknown (a plan compiled from a config object, not a spec: the Deployment runs
    ``parcompile serve`` on the spec), and none for a disaggregated serve plan: the serve program
    does not run separate prefill and decode pools (issue 45; ``parcompile serve`` refuses the
    spec), so there is no DisaggregatedSet to write yet; ``export --to vllm|sglang`` gives the pools'
    servers.

    Raises:
        K8sError: as :func:`manifests`."""
    if cfg.workload == "serve" and (cfg.serve.disaggregated or (cfg.cluster.nodes == 1 and spec_text is None)):
        (options or K8sOptions()).checked()
        return {}
    header = f"# {object_name(cfg.name)}: Kubernetes manifests generated by parcompile {version()}\n"
    _workdir, _spec_dir, where = workspace_layout(cfg, out_dir)
    if where:   # what the pods open or write, for the volume --storage names to hold
        header += "# the spec's files in the pods:\n" + "".join(
            f"#   {key} = {comment_text(path)}\n" for key, path in sorted(where.items()))
    return {f"k8s/{fname}": header + render(objs)
            for fname, objs in sorted(manifests(cfg, files, options, spec_text, out_dir).items())}


#: every file :func:`k8s_files` may write (``Plan.write`` removes those a new plan does not produce)
K8S_FILES = tuple(f"k8s/{n}" for n in ("configmap.yaml", "jobset.yaml", "deployment.yaml", "service.yaml",
                                        "leaderworkerset.yaml"))
