"""Run a rendered Helm release as local "pods": one network namespace and one IP per pod.

What a cluster would do, done here with the kernel's own pieces (root needed):

* network: a bridge on the host, a veth pair per pod (``eth0`` in the pod's
  namespace, a default route via the bridge), so pods reach each other and the
  host reaches them by IP, as on a flat pod network;
* DNS: each namespace gets ``/etc/netns/<ns>/hosts`` (``ip netns exec`` binds it
  over ``/etc/hosts``) naming every Service: a headless Service has one line per
  ready pod (getaddrinfo returns them all, as cluster DNS returns one A record per
  endpoint); a ClusterIP Service points at its ready pods' IPs (no kube-proxy);
  the file is rewritten in place (same inode) whenever readiness changes;
* containers: the image's ENTRYPOINT/CMD read from its Dockerfile, replaced by
  the container's ``command``/``args`` as Kubernetes does; the Dockerfile's ENV
  plus the container's env; each volume bind-mounted at its mountPath in a
  private mount namespace (hostPath -> that path, emptyDir -> a fresh per-pod
  directory, ``medium: Memory`` -> a tmpfs); the pod's runAsUser/runAsGroup via
  setpriv; the image's /opt/venv is this checkout's virtualenv;
* KubeRay: the head and worker containers run the ``ray start`` command and env
  KubeRay generates from rayStartParams and the container resources;
* kubelet: startup, then readiness and liveness probes as declared (gRPC health
  Check on podIP:port with the declared service name, httpGet, tcpSocket, exec
  inside the namespace), honouring period/timeout/failureThreshold.

Everything is torn down by ``Cluster.close()`` (processes found through
``ip netns pids``, namespaces, bridge, files), which the test calls in a finalizer.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.test_deploy_images import command_of, final_stage

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
CLUSTER_DOMAIN = "svc.cluster.local"
# KubeRay's fixed ports and defaults (ray-operator/controllers/ray/utils/constant.go).
RAY_GCS_PORT, RAY_DASHBOARD_AGENT_PORT, RAY_METRICS_PORT = 6379, 52365, 8080
# image repository suffix -> Dockerfile it is built from
# The kubelet's restart back-off: 10 s, doubling. Kubernetes caps it at 5 minutes; the cap here
# is shorter so that a pod which crashes a few times while its dependencies start (a Ray head on
# a busy node) still gets several more tries within a test's readiness deadline.
RESTART_BACKOFF_FIRST_S, RESTART_BACKOFF_MAX_S = 10.0, 40.0
DOCKERFILES = {"mask-service": "mask-service", "orchestrator": "orchestrator", "gpu-worker": "gpu-worker"}


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def netns_unavailable_reason() -> str | None:
    """Why pods cannot be emulated here (None: they can): root and ``ip netns`` are needed."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and mount namespaces); this run is not root"
    for tool in ("ip", "unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool!r} not installed (iproute2 / util-linux)"
    name = f"smprobe{os.getpid()}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


@functools.cache
def can_run_as(uid: int, gid: int) -> bool:
    """Whether the venv's Python runs as ``uid`` (it may live under a private home directory).

    Through a shell that forks, as the pods run it: on some kernels a direct exec
    passes where a child's exec would not."""
    script = f"{shlex.quote(sys.executable)} -c '' && exit 0"
    return _run(*setpriv(uid, gid), "/bin/sh", "-c", script, check=False).returncode == 0


def setpriv(uid: int, gid: int) -> list[str]:
    """Become the pod's user with no capabilities (the chart drops ALL)."""
    drop = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *drop, "--"]


# ---------------------------------------------------------------- images


@dataclass(frozen=True)
class Image:
    entrypoint_cmd: list[str]
    env: dict[str, str]
    workdir: str


def image_for(repository: str) -> Image:
    """ENTRYPOINT+CMD, ENV and WORKDIR of the final stage of the Dockerfile building ``repository``."""
    (dockerfile,) = [d for suffix, d in DOCKERFILES.items() if repository.endswith("/" + suffix)]
    env: dict[str, str] = {}
    workdir = "/"
    for keyword, rest in final_stage(dockerfile):
        if keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value.replace("$PATH", env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"))
        elif keyword == "WORKDIR":
            workdir = rest
    return Image(command_of(dockerfile), env, workdir)


def _is_within(path: Path, mount_path: Path) -> bool:
    """Whether a volume mounted at ``mount_path`` covers ``path``."""
    return path == mount_path or mount_path in path.parents


def map_venv(text: str) -> str:
    """The images install everything into /opt/venv; here that is this checkout's virtualenv."""
    return text.replace("/opt/venv", str(VENV))


# ---------------------------------------------------------------- pods


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    ports: dict[str, int]  # name -> containerPort
    probes: dict[str, dict[str, Any]]  # startupProbe / readinessProbe / livenessProbe -> spec
    mounts: list[tuple[str, str, bool]]  # (mountPath, volume name, readOnly)


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    spec: dict[str, Any]
    containers: list[Container]
    ip: str = ""
    netns: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # the container's, as it was started
    ready: bool = False
    started: bool = False
    failure: str | None = None
    killed: bool = False
    terminated: bool = False  # deleted (Cluster.terminate) and its processes gone
    restarts: int = 0
    last_restart_reason: str | None = None  # why the container was last restarted

    def port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        for c in self.containers:
            if port in c.ports:
                return c.ports[port]
        raise KeyError(f"{self.name}: no container port named {port!r}")

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def _containers(pod_spec: dict[str, Any], command_for: Callable[[dict[str, Any]], tuple[list[str], dict[str, str]]]):
    out = []
    for c in pod_spec["containers"]:
        argv, extra_env = command_for(c)
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
        env.update(extra_env)
        out.append(
            Container(
                name=c["name"],
                argv=argv,
                env=env,
                workdir=c.get("workingDir", ""),
                ports={p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])},
                probes={k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c},
                mounts=[(m["mountPath"], m["name"], bool(m.get("readOnly"))) for m in c.get("volumeMounts", [])],
            )
        )
    return out


def k8s_argv(c: dict[str, Any]) -> list[str]:
    """Kubernetes semantics: ``command`` replaces ENTRYPOINT (and drops CMD), ``args`` replaces CMD."""
    image = image_for(c["image"].split(":")[0])
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    entry_len = len(image.entrypoint_cmd) - len(_cmd_of(c["image"]))
    entry = image.entrypoint_cmd[:entry_len]
    return [*entry, *(c["args"] if "args" in c else image.entrypoint_cmd[entry_len:])]


def _cmd_of(image_ref: str) -> list[str]:
    repository = image_ref.split(":")[0]
    (dockerfile,) = [d for suffix, d in DOCKERFILES.items() if repository.endswith("/" + suffix)]
    cmds = [json.loads(a) if a.startswith("[") else shlex.split(a) for k, a in final_stage(dockerfile) if k == "CMD"]
    return cmds[-1] if cmds else []


def _quantity_int(q: Any) -> int:
    """CPU (cores, "500m") or memory ("48Gi") quantity -> an integer as KubeRay passes it to ray start."""
    text = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    if text.endswith("m"):
        return max(1, int(text[:-1]) // 1000)
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(float(text))


def kuberay_start(
    cluster: dict[str, Any], group: dict[str, Any], container: dict[str, Any], *, head: bool, head_fqdn: str
) -> tuple[list[str], dict[str, str]]:
    """The command and env KubeRay gives a Ray container (``ray start`` built from rayStartParams)."""
    params = {k: str(v) for k, v in group.get("rayStartParams", {}).items()}
    limits = container.get("resources", {}).get("limits", {})
    if "num-cpus" not in params and "cpu" in limits:
        params["num-cpus"] = str(_quantity_int(limits["cpu"]))
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(_quantity_int(limits["memory"]))
    if "num-gpus" not in params and "nvidia.com/gpu" in limits:
        params["num-gpus"] = str(limits["nvidia.com/gpu"])
    params.setdefault("metrics-export-port", str(RAY_METRICS_PORT))
    params.setdefault("dashboard-agent-listen-port", str(RAY_DASHBOARD_AGENT_PORT))
    if not head:
        params.setdefault("address", f"{head_fqdn}:{RAY_GCS_PORT}")
    flags = " ".join(f"--{k}={v}" for k, v in params.items())
    start = f"ray start {'--head ' if head else ''}--block {flags}"
    env = {
        "RAY_CLUSTER_NAME": cluster["metadata"]["name"],
        "RAY_NODE_TYPE_NAME": "headgroup" if head else group["groupName"],
        "RAY_PORT": str(RAY_GCS_PORT),
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
        "KUBERAY_GEN_RAY_START_CMD": start,
    }
    if head:
        env["RAY_ADDRESS"] = f"127.0.0.1:{RAY_GCS_PORT}"
    else:
        env["RAY_IP"] = env["FQ_RAY_IP"] = head_fqdn
    # KubeRay runs `/bin/bash -lc`; a login shell here would read this host's
    # /etc/profile (Debian's resets PATH), not the image's, so: no -l. The image
    # puts its venv on login shells' PATH too (/etc/profile.d/venv.sh).
    return ["/bin/bash", "-c", "--", f"ulimit -n 65536; {start}"], env


# ---------------------------------------------------------------- cluster


@dataclass
class Service:
    name: str
    selector: dict[str, str]
    ports: dict[int, int | str]  # service port -> targetPort
    headless: bool
    publish_not_ready: bool = False


@dataclass
class Cluster:
    """Pods, Services and the network of one emulated release."""

    namespace: str
    workdir: Path
    env_overrides: dict[str, str] = field(default_factory=dict)  # added to every container (test knobs)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> key -> value
    pods: list[Pod] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000:05d}")
    _subnet: ipaddress.IPv4Network | None = None
    _bridge: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _closed: threading.Event = field(default_factory=threading.Event)

    # ---- from manifests

    def add_manifests(self, docs: list[dict[str, Any]], replicas_for: Callable[[dict[str, Any]], int]) -> None:
        for doc in docs:  # Secrets first: containers read them through env valueFrom
            if doc["kind"] == "Secret":
                data = {k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()}
                self.secrets[doc["metadata"]["name"]] = {**data, **doc.get("stringData", {})}
        for doc in docs:
            kind, meta = doc["kind"], doc["metadata"]
            if kind == "Deployment":
                template = doc["spec"]["template"]
                for i in range(replicas_for(doc)):
                    self.pods.append(
                        Pod(
                            f"{meta['name']}-{i}",
                            template["metadata"]["labels"],
                            template["spec"],
                            _containers(template["spec"], self._k8s_command),
                        )
                    )
            elif kind == "Service":
                spec = doc["spec"]
                self.services.append(
                    Service(
                        meta["name"],
                        spec.get("selector", {}),
                        {p["port"]: p.get("targetPort", p["port"]) for p in spec["ports"]},
                        spec.get("clusterIP") == "None",
                        bool(spec.get("publishNotReadyAddresses")),
                    )
                )
            elif kind == "RayCluster":
                self._add_raycluster(doc)

    def _k8s_command(self, c: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        image = image_for(c["image"].split(":")[0])
        env = dict(image.env)
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                env[e["name"]] = self.secrets[ref["name"]][ref["key"]]
        return k8s_argv(c), env

    def _add_raycluster(self, doc: dict[str, Any]) -> None:
        name = doc["metadata"]["name"]
        head_svc = f"{name}-head-svc"
        head_fqdn = f"{head_svc}.{self.namespace}.{CLUSTER_DOMAIN}"
        groups = [(doc["spec"]["headGroupSpec"], True, 1)]
        for g in doc["spec"]["workerGroupSpecs"]:
            groups.append((g, False, int(g.get("replicas", g.get("minReplicas", 1)))))
        for group, head, count in groups:
            template = group["template"]

            def command_for(c: dict[str, Any], group: dict[str, Any] = group, head: bool = head):
                argv, env = kuberay_start(doc, group, c, head=head, head_fqdn=head_fqdn)
                auth = doc["spec"].get("authOptions", {})
                if auth.get("mode") == "token":  # KubeRay sets both on every Ray container
                    env["RAY_AUTH_MODE"] = "token"
                    env["RAY_AUTH_TOKEN"] = self.secrets[auth.get("secretName") or name]["auth_token"]
                image = image_for(c["image"].split(":")[0])
                full_env = dict(image.env)
                full_env.update(env)
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        full_env[e["name"]] = self.secrets[ref["name"]][ref["key"]]
                return argv, full_env

            kind = "head" if head else group["groupName"]
            for i in range(count):
                labels = dict(template["metadata"].get("labels", {}))
                labels.update({"ray.io/cluster": name, "ray.io/node-type": "head" if head else "worker"})
                self.pods.append(
                    Pod(f"{name}-{kind}-{i}", labels, template["spec"], _containers(template["spec"], command_for))
                )
        # KubeRay's head Service (publishNotReadyAddresses: workers must find the
        # GCS before the head passes its probes).
        ports = {RAY_GCS_PORT: RAY_GCS_PORT, 10001: 10001, 8265: 8265, RAY_METRICS_PORT: RAY_METRICS_PORT}
        self.services.append(
            Service(head_svc, {"ray.io/cluster": name, "ray.io/node-type": "head"}, ports, False, True)
        )

    # ---- network

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _run("ip", "-4", "-o", "addr").stdout
        for third in range(200, 250):
            net = ipaddress.IPv4Network(f"10.{third}.{int(self.tag) % 250}.0/24")
            if str(net.network_address)[:-1] not in used:
                return net
        raise RuntimeError("no free 10.x subnet for the pod network")

    def create_network(self) -> None:
        self._subnet = self._pick_subnet()
        hosts = list(self._subnet.hosts())
        self._bridge = f"smbr{self.tag}"
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{hosts[0]}/{self._subnet.prefixlen}", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for i, pod in enumerate(self.pods, start=1):
            self._attach(pod, i)
        self.sync_endpoints()

    def _attach(self, pod: Pod, i: int) -> None:
        """Pod ``pod`` gets namespace number ``i``: its address, veth pair and hosts file."""
        assert self._subnet is not None
        hosts = list(self._subnet.hosts())
        pod.ip, pod.netns = str(hosts[i]), f"sm{self.tag}p{i}"
        host_if = f"smv{self.tag}p{i}"
        (Path("/etc/netns") / pod.netns).mkdir(parents=True, exist_ok=True)
        # No DNS server in a pod: names are the hosts file's, others fail fast.
        (Path("/etc/netns") / pod.netns / "resolv.conf").write_text(
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
        )
        (Path("/etc/netns") / pod.netns / "hosts").write_text("")
        _run("ip", "netns", "add", pod.netns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
        _run("ip", "link", "set", host_if, "master", self._bridge, "up")
        _run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/{self._subnet.prefixlen}", "dev", "eth0")
        _run("ip", "-n", pod.netns, "link", "set", "lo", "up")
        _run("ip", "-n", pod.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", pod.netns, "route", "add", "default", "via", str(hosts[0]))

    # ---- a Deployment's rollout

    def replace_pod(self, old: Pod, extra_ready: Callable[[Pod], tuple[bool, str]] | None = None) -> Pod:
        """One step of a RollingUpdate with maxSurge 0: ``old`` is deleted (``terminate``) and its
        replacement, a new pod from the same template (new name, new IP), is created at once,
        started and given a kubelet; returns the new pod (not Ready yet)."""
        with self._lock:
            number = len(self.pods) + 1
            new = Pod(f"{old.name}-r{number}", dict(old.labels), old.spec, copy.deepcopy(old.containers))
            self.pods.append(new)
        self._attach(new, number)
        self.sync_endpoints()  # its hosts file, and everyone's with its name
        terminating = threading.Thread(target=self.terminate, args=(old,), name=f"terminate-{old.name}", daemon=True)
        terminating.start()
        self._threads.append(terminating)
        self.start(new)
        kubelet = threading.Thread(
            target=self._kubelet, args=(new, extra_ready), name=f"kubelet-{new.name}", daemon=True
        )
        kubelet.start()
        self._threads.append(kubelet)
        return new

    def terminate(self, pod: Pod) -> None:
        """Pod deletion as the kubelet and the endpoints controller do it: out of the endpoints at
        once, the container's preStop (a sleep), SIGTERM, up to terminationGracePeriodSeconds for
        it to exit, then SIGKILL."""
        with self._lock:
            pod.killed = True  # no restarts, out of every Service
            pod.ready = False
        self.sync_endpoints()
        (c,) = pod.spec["containers"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        time.sleep(float(pre_stop))
        self._kill_netns(pod.netns, signal.SIGTERM)
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        if pod.proc is not None:
            try:
                pod.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pod.failure = f"did not exit within its {grace:g} s grace period after SIGTERM"
        self._kill_netns(pod.netns, signal.SIGKILL)
        pod.terminated = True

    # ---- endpoints / DNS

    def endpoints(self, svc: Service) -> list[Pod]:
        with self._lock:
            return [
                p
                for p in self.pods
                if svc.selector
                and all(p.labels.get(k) == v for k, v in svc.selector.items())
                and not p.killed
                and (p.ready or svc.publish_not_ready)
            ]

    def hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for pod in self.pods:
            lines.append(f"{pod.ip} {pod.name}")
        for svc in self.services:
            names = f"{svc.name}.{self.namespace}.{CLUSTER_DOMAIN} {svc.name}.{self.namespace} {svc.name}"
            lines += [f"{p.ip} {names}" for p in self.endpoints(svc)]
        return "\n".join(lines) + "\n"

    def sync_endpoints(self) -> None:
        """The endpoints controller + cluster DNS: rewrite every namespace's hosts file in place."""
        text = self.hosts_text()
        for pod in self.pods:
            path = Path("/etc/netns") / pod.netns / "hosts"
            if path.exists() and path.read_text() != text:
                with open(path, "r+") as f:  # same inode: `ip netns exec` bind-mounted this file
                    f.seek(0)
                    f.write(text)
                    f.truncate()

    def service_address(self, name: str, port: int) -> str:
        """host:port a client outside the namespaces uses for Service ``name`` (first ready endpoint)."""
        (svc,) = [s for s in self.services if s.name == name]
        pods = self.endpoints(svc)
        if not pods:
            raise RuntimeError(f"Service {name} has no ready endpoints")
        return f"{pods[0].ip}:{pods[0].port(svc.ports[port])}"

    # ---- processes

    def _volume_source(self, pod: Pod, volume: dict[str, Any]) -> tuple[str, str]:
        """(kind, local path): a hostPath as is, an emptyDir as a fresh per-pod dir, Memory as tmpfs."""
        if "hostPath" in volume:
            return "bind", volume["hostPath"]["path"]
        if "persistentVolumeClaim" in volume:
            raise ValueError(f"{pod.name}: render with models.volume.type=hostPath (no PVCs here)")
        if "emptyDir" in volume:
            if volume["emptyDir"].get("medium") == "Memory":
                return "tmpfs", str(volume["emptyDir"].get("sizeLimit", "256Mi")).replace("Mi", "m").replace("Gi", "g")
            path = self.workdir / "pods" / pod.name / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            return "bind", str(path)
        raise ValueError(f"{pod.name}: unsupported volume {volume}")

    def start(self, pod: Pod) -> None:
        (c,) = pod.containers  # every pod in this chart has one container
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        sec = {**pod.spec.get("securityContext", {})}
        uid, gid = sec.get("runAsUser"), sec.get("runAsGroup", sec.get("runAsUser"))
        if uid is not None and not can_run_as(uid, gid):
            logger.warning("%s: this venv's interpreter is not usable by uid %s; running it as root", pod.name, uid)
            uid = gid = None
        script = []
        # A volume mounted over a directory that holds this checkout or its venv (an emptyDir
        # at /tmp, with CI's checkout under /tmp) would hide the image's own files: park those
        # directories first (bind mounts inside the pod's private mount namespace) and bind
        # them back on top of the volumes afterwards.
        hidden = sorted(
            {str(p) for p in (REPO_ROOT, VENV) for m in c.mounts if _is_within(p, Path(m[0]))},
            key=lambda p: p.count("/"),
        )
        parked = []
        for i, path in enumerate(hidden):
            keep = self.workdir / "parked" / pod.name / str(i)
            keep.mkdir(parents=True, exist_ok=True)
            script.append(f"mount --bind {shlex.quote(path)} {shlex.quote(str(keep))}")
            parked.append((path, str(keep)))
        # Shallow mount points first (/tmp before /tmp/ray).
        for mount_path, vol_name, read_only in sorted(c.mounts, key=lambda m: m[0].count("/")):
            kind, src = self._volume_source(pod, volumes[vol_name])
            if kind == "bind" and uid is not None:
                os.chown(src, uid, gid) if src.startswith(str(self.workdir)) else None
            script.append(f"mkdir -p {shlex.quote(mount_path)}")
            if kind == "tmpfs":
                script.append(f"mount -t tmpfs -o size={src},mode=1777 tmpfs {shlex.quote(mount_path)}")
            else:
                script.append(f"mount --bind {shlex.quote(src)} {shlex.quote(mount_path)}")
                if read_only:
                    script.append(f"mount -o remount,bind,ro {shlex.quote(mount_path)}")
        for path, keep in parked:
            script.append(f"mkdir -p {shlex.quote(path)} && mount --bind {shlex.quote(keep)} {shlex.quote(path)}")
        image_workdir = image_for(pod.spec["containers"][0]["image"].split(":")[0]).workdir
        workdir = c.workdir or image_workdir
        script.append(f"cd {shlex.quote(workdir)} 2>/dev/null || cd /tmp")
        drop = shlex.join(setpriv(uid, gid)) if uid is not None else ""
        script.append(f'exec {drop} "$@"')
        env = {k: map_venv(v) for k, v in c.env.items()}
        env.update(self.env_overrides)
        env["HOSTNAME"] = pod.name
        if env.get("HOME", "").startswith("/home/"):
            env["HOME"] = "/tmp"  # the image's home dir does not exist here
        argv = [map_venv(a) for a in c.argv]
        pod.env = env
        pod.log_path = self.workdir / "logs" / f"{pod.name}.log"
        pod.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["ip", "netns", "exec", pod.netns, "unshare", "--mount", "--propagation", "private", "--"]
        cmd += ["/bin/sh", "-c", "; ".join(script[:-1]) + " && " + script[-1], "pod", *argv]
        with open(pod.log_path, "ab") as log:
            pod.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        logger.info("pod %s (%s): %s", pod.name, pod.ip, shlex.join(argv))

    def kill(self, pod: Pod) -> None:
        """Kill every process in the pod's network namespace (SIGKILL: a node loss, not a drain)."""
        with self._lock:
            pod.killed = True
            pod.ready = False
        self._kill_netns(pod.netns, signal.SIGKILL)
        if pod.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(10)

    @staticmethod
    def _kill_netns(netns: str, sig: signal.Signals) -> None:
        pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    # ---- kubelet

    def probe(self, pod: Pod, spec: dict[str, Any]) -> tuple[bool, str]:
        timeout = float(spec.get("timeoutSeconds", 1))
        try:
            if "grpc" in spec:
                from specmask.orchestrator.dev.local_stack import health_status

                g = spec["grpc"]
                status = health_status(f"{pod.ip}:{g['port']}", service=g.get("service", ""), timeout_s=timeout)
                return status == 1, f"grpc health {g.get('service', '')!r}: {status}"
            if "httpGet" in spec:
                h = spec["httpGet"]
                url = f"http://{pod.ip}:{pod.port(h['port'])}{h.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout) as resp:
                    return 200 <= resp.status < 400, f"GET {url}: {resp.status}"
            if "tcpSocket" in spec:
                with socket.create_connection((pod.ip, pod.port(spec["tcpSocket"]["port"])), timeout=timeout):
                    return True, "tcp open"
            if "exec" in spec:
                r = subprocess.run(  # in the container: its namespace and its env
                    ["ip", "netns", "exec", pod.netns, *spec["exec"]["command"]],
                    env=pod.env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                return r.returncode == 0, f"exec rc={r.returncode} {r.stderr[-200:]}"
        except Exception as exc:  # a probe failure of any kind counts as failed, as for the kubelet
            return False, f"{type(exc).__name__}: {exc}"
        raise ValueError(f"unsupported probe {spec}")

    def _kubelet(self, pod: Pod, extra_ready: Callable[[Pod], tuple[bool, str]] | None) -> None:
        """restartPolicy Always: a container that exits, or fails its startup or liveness
        probe, is killed and started again after the kubelet's back-off (10 s, 20 s, 40 s, ...).

        As in Kubernetes, CrashLoopBackOff is not the end: the pod is restarted for as long as the
        cluster runs, and whoever waits for it (wait_ready) decides when it has taken too long;
        the restarts and the last reason are in its description."""
        while not self._closed.is_set() and not pod.killed:
            reason = self._run_container(pod, extra_ready)
            if reason is None or pod.killed:
                return
            pod.restarts += 1
            pod.last_restart_reason = reason
            logger.warning("pod %s: %s; restart %d", pod.name, reason, pod.restarts)
            with self._lock:
                pod.ready = pod.started = False
            self.sync_endpoints()
            self._kill_netns(pod.netns, signal.SIGKILL)
            if pod.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.proc.wait(10)
            backoff_s = min(RESTART_BACKOFF_FIRST_S * 2 ** min(pod.restarts - 1, 16), RESTART_BACKOFF_MAX_S)
            if self._closed.wait(backoff_s):
                return
            self.start(pod)

    def _run_container(self, pod: Pod, extra_ready: Callable[[Pod], tuple[bool, str]] | None) -> str | None:
        """Probe one container run until it must be restarted (returns why) or the cluster closes (None)."""
        (c,) = pod.containers
        startup, readiness = c.probes.get("startupProbe"), c.probes.get("readinessProbe")
        liveness = c.probes.get("livenessProbe")

        def exited() -> str | None:
            if pod.proc is not None and pod.proc.poll() is not None:
                return f"container exited ({pod.proc.returncode})"
            return None

        if startup is not None:
            if self._closed.wait(float(startup.get("initialDelaySeconds", 0))):
                return None
            fails, threshold = 0, int(startup.get("failureThreshold", 3))
            while True:
                ok, why = self.probe(pod, startup)
                if ok:
                    break
                if exited():
                    return f"{exited()} before its startup probe passed"
                fails += 1
                if fails >= threshold:
                    return f"startup probe failed {fails} times ({why})"
                if self._closed.wait(float(startup.get("periodSeconds", 10))):
                    return None
        pod.started = True
        live_fails, next_live = 0, time.monotonic()
        while not self._closed.is_set() and not pod.killed:
            if exited():
                return exited()
            if liveness is not None and time.monotonic() >= next_live:
                ok, why = self.probe(pod, liveness)
                live_fails = 0 if ok else live_fails + 1
                if live_fails >= int(liveness.get("failureThreshold", 3)):
                    return f"liveness probe failed {live_fails} times ({why})"
                next_live = time.monotonic() + float(liveness.get("periodSeconds", 10))
            ok, why = self.probe(pod, readiness) if readiness is not None else (True, "no readiness probe")
            if ok and extra_ready is not None:
                ok, why = extra_ready(pod)
            changed = ok != pod.ready
            with self._lock:
                pod.ready = ok
            if changed:
                logger.info("pod %s ready=%s (%s)", pod.name, ok, why)
                self.sync_endpoints()
            self._closed.wait(float((readiness or {}).get("periodSeconds", 10)) if ok else 1.0)
        return None

    def run_kubelets(self, extra_ready: Callable[[Pod], tuple[bool, str]] | None = None) -> None:
        for pod in self.pods:
            t = threading.Thread(target=self._kubelet, args=(pod, extra_ready), name=f"kubelet-{pod.name}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failed = [p for p in self.pods if p.failure]
            if failed:
                raise AssertionError(self.describe(failed))
            if all(p.ready for p in self.pods if not p.killed):
                return
            time.sleep(0.5)
        raise AssertionError("pods not Ready in time:\n" + self.describe([p for p in self.pods if not p.ready]))

    def describe(self, pods: list[Pod]) -> str:
        return "\n".join(
            f"--- {p.name} ({p.ip}) started={p.started} ready={p.ready} restarts={p.restarts} "
            f"(last: {p.last_restart_reason}) failure={p.failure}\n{p.log_tail()}"
            for p in pods
        )

    # ---- teardown

    def close(self) -> None:
        self._closed.set()
        for pod in self.pods:
            if pod.netns:
                self._kill_netns(pod.netns, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            _run("ip", "netns", "pids", p.netns, check=False).stdout.strip() for p in self.pods if p.netns
        ):
            time.sleep(0.2)
        for pod in self.pods:
            if pod.netns:
                self._kill_netns(pod.netns, signal.SIGKILL)
        for pod in self.pods:
            if pod.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.proc.wait(5)
            if pod.netns:
                _run("ip", "netns", "del", pod.netns, check=False)
                shutil.rmtree(Path("/etc/netns") / pod.netns, ignore_errors=True)
        if self._bridge:
            _run("ip", "link", "del", self._bridge, check=False)
        for t in self._threads:
            t.join(5)


def render_values_note(values: dict[str, Any]) -> str:
    return re.sub(r"\s+", " ", json.dumps(values))
