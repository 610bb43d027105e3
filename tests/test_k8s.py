"""The Kubernetes manifests ``compile`` writes into ``k8s/`` (parcompile/codegen/k8s.py).

Checked against the real references: the JobSet and LeaderWorkerSet manifests against the
CustomResourceDefinitions' own OpenAPI v3 schemas as kubernetes-sigs publish them
(``../shared/data/k8s/``, their README names the commits; every object schema closed, so an
unknown field fails as well as a missing or mistyped one); the core objects (ConfigMap,
Deployment, Service, and the pod templates inside the custom resources) through the
``kubernetes`` Python client's models (deserialized with ApiClient: required fields; every key
checked against the model's attribute map). The JobSet's pod command is compared with the
torchrun line launch.sh really runs (launch.sh executed with a stand-in torchrun that prints
its arguments), the ConfigMap's copy script is run on the ConfigMap's data.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import parcompile
from parcompile.cli import main
from parcompile.codegen import k8s
from parcompile.codegen.k8s import K8sError, K8sOptions
from tests.program_utils import assigned

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
#: ../shared beside the clone (a worktree of it sits one level deeper: ../../shared)
SHARED_K8S = next((p / "shared" / "data" / "k8s" for p in REPO.parents[:2]
                   if (p / "shared" / "data" / "k8s").is_dir()), None)
needs_crds = pytest.mark.skipif(SHARED_K8S is None, reason="../shared/data/k8s (the CRDs' schemas) is not beside "
                                                          "this clone")
TRAIN_EXAMPLES = ["tiny", "llama3_8b_2x8_h100", "llama3_70b_8x8_h100", "mixtral_8x7b_8x8_h100",
                  "deepseek_moe_16b_1x8_h100", "llama3_8b_zero_bubble_1x8_h100"]
SERVE_2_NODES = """model llama from "llama3-70b" { }
cluster dgx from "h100-sxm" { nodes = 2, gpus_per_node = 8 }
parallel { tp = 8, pp = 2 }
serve { batch = 8, prompt_len = 1024, max_new_tokens = 256 }
"""
DISAGGREGATED = """model llama from "llama3-70b" { }
cluster dgx from "h100-sxm" { nodes = 1, gpus_per_node = 8 }
parallel { tp = 4 }
serve { batch = 8, prompt_len = 1024, max_new_tokens = 256, disaggregated = true }
"""
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")   # k8s.io/apimachinery validation.IsDNS1035Label


def _outputs(tmp_path: Path, spec: Path | str, name: str = "out", **opts) -> Path:
    if isinstance(spec, str):
        path = tmp_path / f"{name}.par"
        path.write_text(spec)
        spec = path
    out = tmp_path / name
    parcompile.compile(spec).write(out, K8sOptions(**opts) if opts else None)
    return out


def _docs(out: Path, fname: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((out / "k8s" / fname).read_text()) if d is not None]


# -- the CRDs' schemas ---------------------------------------------------------------------


def _closed(schema):
    """The schema with every object that lists properties closed to others (the API server prunes
    unknown fields silently: here they fail)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _crd_validator(fname: str, version: str):
    import jsonschema

    crd = yaml.safe_load((SHARED_K8S / fname).read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(_closed(schema)), crd["spec"]["group"], crd["spec"]["names"]["kind"]


def _validate_crd(obj: dict, fname: str) -> None:
    group, version = obj["apiVersion"].split("/")
    validator, crd_group, kind = _crd_validator(fname, version)
    assert (group, obj["kind"]) == (crd_group, kind)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    assert not errors, errors


# -- the kubernetes client's models --------------------------------------------------------


def _check_model(data, annotation, path: str = "") -> None:
    """Every key of ``data`` is a field of the client's model ``annotation`` (recursively through
    its lists, dicts and nested models): the client's ``from_dict`` drops unknown keys unread."""
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or origin is typing.Annotated:
        for a in args:
            if a is not type(None):
                _check_model(data, a, path)
                return
        return
    if origin is list:
        for i, item in enumerate(data):
            _check_model(item, args[0], f"{path}[{i}]")
        return
    if origin is dict:
        for k, v in data.items():
            _check_model(v, args[1], f"{path}.{k}")
        return
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return
    fields = {(f.serialization_alias or f.alias or n): f for n, f in annotation.model_fields.items()}   # JSON names
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{path or annotation.__name__}: no field {unknown} in {annotation.__name__}"
    for key, value in data.items():
        if value is not None:
            _check_model(value, fields[key].annotation, f"{path}.{key}")


def _validate_core(obj: dict, type_name: str) -> None:
    """``obj`` through the client's model: deserialized (required fields present, enums and
    types as the model's setters check them) and every key a field of its model."""
    from kubernetes.client import ApiClient

    import kubernetes.client.models as models

    ApiClient()._ApiClient__deserialize(obj, type_name)   # pydantic: a missing required field or a wrong type raises
    _check_model(obj, getattr(models, type_name))


# -- the tests -----------------------------------------------------------------------------


@needs_crds
@pytest.mark.parametrize("example", TRAIN_EXAMPLES)
def test_training_jobset_validates_against_the_crd_schema(tmp_path, example):
    out = _outputs(tmp_path, EXAMPLES / f"{example}.par")
    assert sorted(p.name for p in (out / "k8s").iterdir()) == ["configmap.yaml", "jobset.yaml"]
    (jobset,) = _docs(out, "jobset.yaml")
    _validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    cfg = parcompile.compile(EXAMPLES / f"{example}.par").config
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    _validate_core(job, "V1JobSpec")
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (cfg.cluster.nodes,) * 2 + ("Indexed",)
    (container,) = job["template"]["spec"]["containers"]
    limits = container.get("resources", {}).get("limits", {})
    assert limits == ({} if cfg.cluster.device_kind == "cpu" else {"nvidia.com/gpu": str(cfg.cluster.gpus_per_node)})
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == f"expandable_segments:{cfg.cluster.expandable_segments}"
    for cm in _docs(out, "configmap.yaml"):
        _validate_core(cm, "V1ConfigMap")


@needs_crds
def test_the_schema_checks_can_fail(tmp_path):
    """A misspelt field, a wrong type, a missing required field: each refused."""
    import copy

    (jobset,) = _docs(_outputs(tmp_path, EXAMPLES / "tiny.par"), "jobset.yaml")
    for path, value in ((("spec", "replicatedJobs", 0, "replica"), 1), (("spec", "replicatedJobs", 0, "replicas"), "1"),
                        (("spec", "network", "enableDNSHostnames"), "yes")):
        bad = copy.deepcopy(jobset)
        node = bad
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(AssertionError):
            _validate_crd(bad, "jobset.x-k8s.io_jobsets.yaml")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(AssertionError):
        _validate_core(bad, "V1PodTemplateSpec")
    bad = copy.deepcopy(pod)
    del bad["spec"]["containers"][0]["name"]
    with pytest.raises(Exception):
        _validate_core(bad, "V1PodTemplateSpec")


@needs_crds
def test_multi_node_serving_is_a_leaderworkerset_that_validates(tmp_path):
    out = _outputs(tmp_path, SERVE_2_NODES, "serve2")
    assert sorted(p.name for p in (out / "k8s").iterdir()) == ["configmap.yaml", "leaderworkerset.yaml"]
    (lws,) = _docs(out, "leaderworkerset.yaml")
    _validate_crd(lws, "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    _validate_core(template["workerTemplate"], "V1PodTemplateSpec")
    cmd = template["workerTemplate"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "$(LWS_LEADER_ADDRESS):$(MASTER_PORT)"


def test_single_node_serving_is_a_deployment_and_service_running_parcompile_serve(tmp_path):
    spec = EXAMPLES / "llama3_70b_serve_8x_h100.par"
    out = _outputs(tmp_path, spec, namespace="llm", image="registry.example.com:5000/team/pc:1.2", storage="models")
    assert sorted(p.name for p in (out / "k8s").iterdir()) == ["configmap.yaml", "deployment.yaml", "service.yaml"]
    (dep,), (svc,) = _docs(out, "deployment.yaml"), _docs(out, "service.yaml")
    _validate_core(dep, "V1Deployment")
    _validate_core(svc, "V1Service")
    (cm,) = _docs(out, "configmap.yaml")
    _validate_core(cm, "V1ConfigMap")
    assert {o["metadata"]["namespace"] for o in (dep, svc, cm)} == {"llm"}
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example.com:5000/team/pc:1.2"
    assert c["command"][:3] == ["parcompile", "serve", f"/workspace/{spec.name}"]
    assert cm["data"][spec.name] == spec.read_text()
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert {"name": "workspace", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    # the CLI's --help names the flags the manifests take
    r = subprocess.run([sys.executable, "-m", "parcompile", "compile", "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert all(f in r.stdout for f in ("--image", "--namespace", "--storage"))


def _k8s_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in a container's command (``$$`` an escaped ``$``;
    an undefined variable left as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def _launch_argv(out: Path, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """What launch.sh execs: run with a torchrun that prints its arguments as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run_env.update(env, PATH=f"{bin_dir}:{run_env['PATH']}", PYTHONPATH=str(REPO))
    r = subprocess.run([str(out / "launch.sh")], env=run_env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return ["torchrun"] + json.loads(r.stdout)


@pytest.mark.parametrize("example", ["llama3_8b_2x8_h100", "tiny"])
def test_jobset_pod_runs_the_torchrun_line_of_launch_sh(tmp_path, example):
    """Each pod's command, with the variables Kubernetes expands in it (its node rank from the Job
    completion index annotation), is the torchrun line launch.sh runs on that node with
    NODE_RANK and MASTER_ADDR set: the same ranks, the same rendezvous; the rendezvous host is the
    JobSet's first pod by its headless service's name."""
    out = _outputs(tmp_path, EXAMPLES / f"{example}.par")
    (jobset,) = _docs(out, "jobset.yaml")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    (c,) = job["template"]["spec"]["containers"]
    for index in range(job["completions"]):
        env = {}
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = _k8s_expand(e["value"], env)
            else:   # the downward API: the pod's annotation the Job controller sets
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == \
                    "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                env[e["name"]] = str(index)
        pod_argv = [_k8s_expand(a, env) for a in c["command"]]
        assert not any("$(" in a for a in pod_argv), pod_argv
        launch_env = {}
        if job["completions"] > 1:
            host = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{jobset['spec']['network']['subdomain']}"
            assert env["MASTER_ADDR"] == host and len(host.split(".")[0]) <= 63
            launch_env = {"NODE_RANK": str(index), "MASTER_ADDR": host}
        launch_argv = _launch_argv(out, tmp_path, launch_env)
        assert Path(launch_argv[-1]).name == Path(pod_argv[-1]).name == "program.py"
        assert Path(pod_argv[-1]).parent.as_posix() == c["workingDir"]
        assert launch_argv[:-1] == pod_argv[:-1]


def test_leaderworkerset_pods_run_the_torchrun_line_of_launch_sh(tmp_path):
    """Multi-node serving: each pod of the group, with the variables LWS adds (its worker index,
    the leader's address), runs what launch.sh of the serve program runs on that node."""
    out = _outputs(tmp_path, SERVE_2_NODES, "serve2")
    (lws,) = _docs(out, "leaderworkerset.yaml")
    (c,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    leader = "serve2-0.serve2.default"
    for index in range(lws["spec"]["leaderWorkerTemplate"]["size"]):
        env = {"LWS_LEADER_ADDRESS": leader, "LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": "2"}
        env.update({e["name"]: _k8s_expand(e["value"], env) for e in c["env"]})
        pod_argv = [_k8s_expand(a, env) for a in c["command"]]
        launch_argv = _launch_argv(out, tmp_path, {"NODE_RANK": str(index), "MASTER_ADDR": leader})
        assert Path(launch_argv[-1]).name == Path(pod_argv[-1]).name == "serve.py"
        assert launch_argv[:-1] == pod_argv[:-1]


def test_configmap_copy_script_rebuilds_the_files_and_splits_over_1_mib(tmp_path, monkeypatch):
    """A plan whose files exceed a ConfigMap's 1 MiB is split over several (each within it, a file
    cut into parts); the init container's script, run on the ConfigMaps' data, rebuilds every file
    byte for byte."""
    monkeypatch.setattr(k8s, "CONFIGMAP_MAX_BYTES", 4_000)   # the same rule, on a small plan
    out = _outputs(tmp_path, EXAMPLES / "tiny.par")
    maps = _docs(out, "configmap.yaml")
    assert len(maps) > 1 and any(".part-" in key for m in maps for key in m["data"])
    assert all(sum(len(v.encode()) for v in m["data"].values()) <= k8s.CONFIGMAP_MAX_BYTES for m in maps)
    (jobset,) = _docs(out, "jobset.yaml")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "files")
    assert [s["configMap"]["name"] for s in volume["projected"]["sources"]] == [m["metadata"]["name"] for m in maps]
    if SHARED_K8S is not None:
        _validate_crd(jobset, "jobset.x-k8s.io_jobsets.yaml")
    mount, work = tmp_path / "mount", tmp_path / "work"
    mount.mkdir()
    work.mkdir()
    for m in maps:
        for key, value in m["data"].items():
            (mount / key).write_text(value)
    (init,) = pod["initContainers"]
    script = init["command"][2].replace(k8s.FILES_MOUNT, str(mount)).replace(k8s.WORKSPACE, str(work))
    subprocess.run(["sh", "-c", script], check=True, timeout=60)
    for name in ("plan.json", "program.py"):
        assert (work / name).read_bytes() == (out / name).read_bytes()


@pytest.mark.parametrize("preset, resource, env", [
    ("h100-sxm", "nvidia.com/gpu", {"PYTORCH_CUDA_ALLOC_CONF"}),
    ("mi300x", "amd.com/gpu", {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"}),
    ("ascend-910b", "huawei.com/Ascend910", {"PYTORCH_NPU_ALLOC_CONF", "HCCL_CONNECT_TIMEOUT"}),
    ("cpu", None, {"PYTORCH_CUDA_ALLOC_CONF"}),
])
def test_each_accelerator_requests_its_device_plugins_resource(tmp_path, preset, resource, env):
    """The pods request the devices by the name the vendor's device plugin advertises, and carry
    what the launchers set for the stack (launch.sh's exports; the allocator mode program.py sets)."""
    from parcompile.core.process import PROCESS_GROUP_TIMEOUT_S

    spec = (EXAMPLES / "llama3_8b_2x8_h100.par").read_text().replace('"h100-sxm"', f'"{preset}"')
    out = _outputs(tmp_path, spec, "acc")
    (jobset,) = _docs(out, "jobset.yaml")
    (c,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert c.get("resources", {}).get("limits", {}) == ({resource: "8"} if resource else {})
    names = {e["name"] for e in c["env"]} - {"NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"}
    assert names == env
    launch = (out / "launch.sh").read_text()
    for e in c["env"]:
        if e["name"] == "HCCL_CONNECT_TIMEOUT":
            assert e["value"] == str(PROCESS_GROUP_TIMEOUT_S) and 'export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-' in launch
        if e["name"].endswith("_ALLOC_CONF"):
            assert f'os.environ.setdefault("{e["name"]}", "{e["value"]}")' in (out / "program.py").read_text()


def test_manifests_are_deterministic(tmp_path):
    a = _outputs(tmp_path, EXAMPLES / "llama3_8b_2x8_h100.par", "a")
    b = _outputs(tmp_path, EXAMPLES / "llama3_8b_2x8_h100.par", "b")
    for f in ("jobset.yaml", "configmap.yaml"):
        assert (a / "k8s" / f).read_bytes() == (b / "k8s" / f).read_bytes()


@pytest.mark.parametrize("flag, value", [
    ("--namespace", "my team"), ("--namespace", 'ns"x'), ("--namespace", "a" * 64), ("--namespace", "Prod"),
    ("--image", "my image:1"), ("--image", "img'; rm -rf /"), ("--image", ""), ("--image", "pc:v\u00e9"),
    ("--storage", "a b"),
    ("--namespace", "x\ny"), ("--namespace", ""),
])
def test_hostile_options_are_one_line_usage_errors_and_nothing_is_written(tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    assert main(["compile", str(EXAMPLES / "tiny.par"), "-o", str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"parcompile: error: {flag} "), err
    assert not out.exists()
    # an earlier output directory keeps its files as they were
    assert main(["compile", str(EXAMPLES / "tiny.par"), "-o", str(out)]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["compile", str(EXAMPLES / "tiny.par"), "-o", str(out), flag, value]) == 2
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(K8sError):
        parcompile.compile(EXAMPLES / "tiny.par").write(tmp_path / "api", K8sOptions(**{flag[2:]: value}))
    assert not (tmp_path / "api").exists()


@pytest.mark.parametrize("stem", ["x" * 80, "Llama 3 (8B) run #2", "3d_parallel", "ünïcode-spec"])
def test_a_spec_name_that_is_no_dns_label_gets_a_valid_derived_name(tmp_path, stem):
    out = _outputs(tmp_path, (EXAMPLES / "llama3_8b_2x8_h100.par").read_text(), stem)
    (jobset,) = _docs(out, "jobset.yaml")
    name = jobset["metadata"]["name"]
    pod_host = f"{name}-{jobset['spec']['replicatedJobs'][0]['name']}-0-1"
    assert DNS1035.match(name) and DNS1035.match(pod_host) and len(pod_host) <= 63, pod_host
    for cm in _docs(out, "configmap.yaml"):
        assert DNS1035.match(cm["metadata"]["name"]) and len(cm["metadata"]["name"]) <= 63


def test_an_output_of_another_workload_loses_the_earlier_manifests(tmp_path):
    """A rerun removes the manifests the new plan does not have, never a file the user put in
    k8s/; a k8s/ left empty goes too."""
    out = tmp_path / "out"
    assert main(["compile", str(EXAMPLES / "tiny.par"), "-o", str(out)]) == 0
    assert (out / "k8s" / "jobset.yaml").is_file()
    (out / "k8s" / "kustomization.yaml").write_text("resources: [jobset.yaml]\n")
    assert main(["compile", str(EXAMPLES / "tiny_serve.par"), "-o", str(out)]) == 0
    assert sorted(p.name for p in (out / "k8s").iterdir()) == ["configmap.yaml", "deployment.yaml",
                                                               "kustomization.yaml", "service.yaml"]
    disaggregated = tmp_path / "dis.par"
    disaggregated.write_text(DISAGGREGATED)
    assert main(["compile", str(disaggregated), "-o", str(out)]) == 0
    assert [p.name for p in (out / "k8s").iterdir()] == ["kustomization.yaml"]
    (out / "k8s" / "kustomization.yaml").unlink()
    assert main(["compile", str(EXAMPLES / "tiny.par"), "-o", str(out)]) == 0
    assert main(["compile", str(disaggregated), "-o", str(out)]) == 0
    assert not (out / "k8s").exists()


@pytest.mark.parametrize("fname", ["my serve (1).par", "..serve.par", "s" * 250 + ".par"])
def test_a_spec_file_name_that_is_no_configmap_key_is_carried_as_spec_par(tmp_path, fname):
    """The Deployment's spec under a ConfigMap key the API server accepts: ``spec.par`` when the
    file's name is none (k8s.io/apimachinery validation.IsConfigMapKey: characters a key may not
    hold, a leading '..', over 253 characters)."""
    spec = tmp_path / fname
    spec.write_text((EXAMPLES / "llama3_70b_serve_8x_h100.par").read_text())
    out = tmp_path / "out"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    (cm,) = _docs(out, "configmap.yaml")
    (dep,) = _docs(out, "deployment.yaml")
    assert cm["data"]["spec.par"] == spec.read_text()
    assert dep["spec"]["template"]["spec"]["containers"][0]["command"][2] == "/workspace/spec.par"
    _validate_core(cm, "V1ConfigMap")
    assert DNS1035.match(dep["metadata"]["name"]) and len(dep["metadata"]["name"]) <= 40
    assert fname != "my serve (1).par" or dep["metadata"]["name"] == "my-serve-1"


@pytest.mark.parametrize("brk", ["\x85", "\u2028", "\u2029", "\t"])
def test_a_spec_with_yaml_s_other_line_breaks_is_carried_byte_for_byte(tmp_path, brk):
    """The ConfigMap holds the spec the pod compiles exactly: a comment holding a NEL (U+0085, a
    line break to YAML), U+2028, U+2029 or a tab does not come back as a new line of spec (a CR is
    read as a line end by the frontend already)."""
    text = f"# r\u00e9sum\u00e9{brk}# tp = 2\n" + (EXAMPLES / "tiny_serve.par").read_text()
    out = _outputs(tmp_path, text, "lines")
    (cm,) = _docs(out, "configmap.yaml")
    assert cm["data"]["lines.par"] == text
    assert cm["data"]["plan.json"] == (out / "plan.json").read_text()


def test_a_disaggregated_serve_spec_gets_no_manifests(tmp_path, capsys):
    """`parcompile serve` refuses a disaggregated spec (the serve program has no separate pools
    yet): compile writes no Deployment that could not start, and no DisaggregatedSet."""
    spec = tmp_path / "dis.par"
    spec.write_text(DISAGGREGATED)
    out = tmp_path / "out"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    assert "does not run disaggregated prefill and decode pools" in capsys.readouterr().err
    assert (out / "serve.py").is_file() and not (out / "k8s").exists()


def test_the_specs_relative_paths_land_in_the_workspace(tmp_path):
    """The program's relative paths climb out of its directory (`-o build/run1`, data in
    `../data`): the pods place the program as deep in the workspace as those paths climb, the
    real directories' names kept (`/workspace/build/run1`), so that each path lands inside the
    volume where it lies beside the project on this machine (`/workspace/data/train.jsonl`), and
    the manifests' header lists them. Was: the program at `/workspace/program.py`, its
    `../../data/train.jsonl` at `/data/train.jsonl`, outside the volume (and a checkpoint or
    hf_output written there lost with the pod). Checked by running the init container's script on
    a stand-in workspace and resolving the program's paths as it does."""
    from parcompile.runtime.data.loader import resolve_source
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "specs").mkdir()
    (proj / "data" / "train.jsonl").write_text('{"text": "hello there, a line of text"}\n' * 20)
    text = (EXAMPLES / "tiny.par").read_text().replace('"builtin:pydoc"', '"../data/train.jsonl"')
    text = text.replace("train {\n", 'train {\n    checkpoint_dir = "../ckpt"\n', 1)
    (proj / "specs" / "ft.par").write_text(text)
    out = proj / "build" / "run1"
    parcompile.compile(proj / "specs" / "ft.par").write(out)
    (jobset,) = _docs(out, "jobset.yaml")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][-1] == "/workspace/build/run1/program.py" and c["workingDir"] == "/workspace/build/run1"
    header = (out / "k8s" / "jobset.yaml").read_text().split("---")[0]
    assert "#   train.data = /workspace/data/train.jsonl\n" in header
    assert "#   train.checkpoint_dir = /workspace/ckpt\n" in header
    mount, work = tmp_path / "mount", tmp_path / "work"
    mount.mkdir()
    work.mkdir()
    for m in _docs(out, "configmap.yaml"):
        for key, value in m["data"].items():
            (mount / key).write_text(value)
    (init,) = pod["initContainers"]
    script = init["command"][2].replace(k8s.FILES_MOUNT, str(mount)).replace(k8s.WORKSPACE, str(work))
    subprocess.run(["sh", "-c", script], check=True, timeout=60)
    program = work / "build" / "run1" / "program.py"
    here = program.resolve().parent
    source = program.read_text()
    assert Path(resolve_source(assigned(source, "DATA"), here)) == work.resolve() / "data" / "train.jsonl"
    assert Path(resolve_source(assigned(source, "TRAIN")["checkpoint_dir"], here)) == work.resolve() / "ckpt"


def test_a_single_node_serving_pod_compiles_its_spec_where_its_weights_land(tmp_path):
    """The Deployment's pod compiles the spec itself: the spec sits as deep in the workspace as its
    own relative paths climb (examples/tiny_serve.par's `weights = "../build/tiny_ckpt"`:
    `/workspace/examples/tiny_serve.par`, the weights `/workspace/build/tiny_ckpt`), and the pod
    compiles into a directory of its own, not the user's `build/`. Was: the spec at
    `/workspace/tiny_serve.par`, its weights outside the volume, `-o /workspace/build`."""
    proj = tmp_path / "proj"
    (proj / "examples").mkdir(parents=True)
    spec = proj / "examples" / "tiny_serve.par"
    spec.write_text((EXAMPLES / "tiny_serve.par").read_text())
    out = proj / "out"
    parcompile.compile(spec).write(out)
    (dep,) = _docs(out, "deployment.yaml")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:5] == ["parcompile", "serve", "/workspace/examples/tiny_serve.par", "-o",
                                "/workspace/parcompile-serve"]
    assert c["workingDir"] == "/workspace/examples"
    assert "#   serve.weights = /workspace/build/tiny_ckpt\n" in (out / "k8s" / "deployment.yaml").read_text()
    (init,) = pod["initContainers"]
    assert "cat /etc/parcompile/tiny_serve.par > /workspace/examples/tiny_serve.par" in init["command"][2]
