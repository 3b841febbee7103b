#!/usr/bin/env python3
"""Check deploy/k8s, deploy/systemd and deploy/etcd against the code.

Usage: check_manifests.py REPO_DIR SX_AGENT_HELP_FILE [ETCD_HELP_FILE]

- every YAML document parses and names apiVersion, kind and metadata.name;
- the sx-agent DaemonSet has what the README promises: readiness on /ready,
  liveness on /healthz, the metrics port in its Prometheus annotations and
  in --metrics-listen, IPC_LOCK and nothing else, equal hugepages requests
  and limits, the RDMA device resource;
- every sx-agent option used by a manifest or the systemd env example is an
  option `sx-agent --help` prints;
- the Redis ConfigMap keeps deploy/redis's ACL lines and the settings that
  matter;
- every ETCD_* variable in deploy/etcd is a flag `etcd --help` knows.
Prints one line per failure and exits 1 if there was any.
"""
import os
import re
import sys

try:
    import yaml
except ImportError:
    print("  SKIP  manifests: python3-yaml is not installed")
    sys.exit(0)

repo, help_file = sys.argv[1], sys.argv[2]
etcd_help = sys.argv[3] if len(sys.argv) > 3 else ""
errors = []


def bad(msg):
    errors.append(msg)


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


k8s = os.path.join(repo, "deploy", "k8s")
docs = {}
for name in sorted(os.listdir(k8s)):
    if not name.endswith(".yaml"):
        continue
    try:
        docs[name] = load(os.path.join(k8s, name))
    except yaml.YAMLError as e:
        bad(f"{name}: not YAML: {e}")
        continue
    for d in docs[name]:
        if name == "kustomization.yaml":
            continue
        for field in ("apiVersion", "kind"):
            if field not in d:
                bad(f"{name}: a document without {field}")
        if not d.get("metadata", {}).get("name"):
            bad(f"{name}: {d.get('kind')} without metadata.name")

# kustomization: every resource exists.
for res in docs.get("kustomization.yaml", [{}])[0].get("resources", []):
    if not os.path.exists(os.path.join(k8s, res)):
        bad(f"kustomization.yaml: resource {res} does not exist")


def find(kind, name):
    for ds in docs.values():
        for d in ds:
            if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
                return d
    bad(f"no {kind} {name} in deploy/k8s")
    return {}


with open(help_file) as f:
    agent_opts = set(re.findall(r"--[a-z][a-z0-9-]*", f.read()))


def check_args(where, args):
    for a in args:
        m = re.match(r"(--[a-z][a-z0-9-]*)", a)
        if m and m.group(1) not in agent_opts:
            bad(f"{where}: sx-agent has no option {m.group(1)}")


# ------------------------------------------------------------ sx-agent
ds = find("DaemonSet", "sx-agent")
spec = ds.get("spec", {}).get("template", {})
pod = spec.get("spec", {})
ann = spec.get("metadata", {}).get("annotations", {})
cs = pod.get("containers", [{}])
c = cs[0] if cs else {}
args = c.get("args", [])
check_args("sx-agent.yaml", args)
ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
mport = ports.get("metrics")
if ann.get("prometheus.io/scrape") != "true" or str(ann.get("prometheus.io/port")) != str(mport):
    bad("sx-agent.yaml: prometheus.io annotations do not name the metrics port")
if not any(a.startswith("--metrics-listen=") and a.endswith(f":{mport}") for a in args):
    bad("sx-agent.yaml: --metrics-listen does not serve the metrics port")
if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/ready":
    bad("sx-agent.yaml: the readiness probe is not GET /ready")
if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
    bad("sx-agent.yaml: the liveness probe is not GET /healthz")
sc = c.get("securityContext", {})
caps = sc.get("capabilities", {})
if caps.get("add") != ["IPC_LOCK"] or caps.get("drop") != ["ALL"]:
    bad("sx-agent.yaml: capabilities must be drop ALL, add IPC_LOCK")
res = c.get("resources", {})
req, lim = res.get("requests", {}), res.get("limits", {})
hp = [k for k in lim if k.startswith("hugepages-")]
if not hp:
    bad("sx-agent.yaml: no hugepages limit")
for k in hp:
    if req.get(k) != lim.get(k):
        bad(f"sx-agent.yaml: {k} requests and limits differ (Kubernetes requires equal)")
if hp and not any(a.startswith("--hugepages=") for a in args):
    bad("sx-agent.yaml: hugepages requested but sx-agent is not given --hugepages")
if "memory" not in req:
    bad("sx-agent.yaml: hugepages need a memory (or cpu) request as well")
if not any(k.startswith("rdma/") for k in lim):
    bad("sx-agent.yaml: no RDMA device resource (rdma/...)")
env = {e["name"]: e for e in c.get("env", [])}
url = env.get("SX_METADATA_URL", {}).get("value", "")
if "$(SX_AGENT_PASSWORD)" not in url or "PASSWORD" in url.replace("$(SX_AGENT_PASSWORD)", ""):
    bad("sx-agent.yaml: SX_METADATA_URL must take its password from the Secret")

# ------------------------------------------------------------ systemd
envfile = os.path.join(repo, "deploy", "systemd", "sx-agent.env.example")
with open(envfile) as f:
    for line in f:
        if line.startswith("SX_AGENT_ARGS="):
            check_args("sx-agent.env.example", line.split("=", 1)[1].split())

# ------------------------------------------------------------ redis
cm = find("ConfigMap", "sx-redis-config").get("data", {})


def lines(text):
    return [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]


with open(os.path.join(repo, "deploy", "redis", "users.acl")) as f:
    if lines(f.read()) != lines(cm.get("users.acl", "")):
        bad("redis-sentinel.yaml: users.acl differs from deploy/redis/users.acl")


def settings(text):
    out = {}
    for l in lines(text):
        k, _, v = l.partition(" ")
        out[k] = v
    return out


with open(os.path.join(repo, "deploy", "redis", "redis.conf")) as f:
    want = settings(f.read())
have = settings(cm.get("redis.conf", ""))
for k in ("maxmemory", "maxmemory-policy", "appendonly", "appendfsync", "save",
          "notify-keyspace-events", "masteruser"):
    if have.get(k) != want.get(k):
        bad(f"redis-sentinel.yaml: redis.conf {k} is {have.get(k)!r}, deploy/redis has {want.get(k)!r}")

# ------------------------------------------------------------ etcd
if etcd_help:
    with open(etcd_help) as f:
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", f.read()))
    d = os.path.join(repo, "deploy", "etcd")
    for name in sorted(os.listdir(d)):
        if not name.endswith(".env"):
            continue
        with open(os.path.join(d, name)) as f:
            for line in f:
                m = re.match(r"ETCD_([A-Z0-9_]+)=", line)
                if m:
                    flag = "--" + m.group(1).lower().replace("_", "-")
                    if flag not in flags:
                        bad(f"deploy/etcd/{name}: etcd has no flag {flag} (ETCD_{m.group(1)})")

for e in errors:
    print(f"  FAIL  manifests: {e}")
sys.exit(1 if errors else 0)
