"""segxfer's LMDeploy backend as LMDeploy itself drives it, found the way
LMDeploy finds it.

Read from LMDeploy's source, github.com/InternLM/lmdeploy at commit
1263d5cd889b7ad500e85b8eb20401327a4516ab (2026-08-21):
- lmdeploy/pytorch/engine/cache_engine.py, CacheEngine.p2p_initialize,
  p2p_connect and migrate (the calls a backend sees; tests/python/standin/
  lmdeploy/pytorch/engine/cache_engine.py does the same steps);
- lmdeploy/pytorch/disagg/conn/proxy_conn.py, conn_worker: the proxy sends
  DistServeInitRequest to the prefill engine, then to the decode engine,
  then DistServeConnectionRequest to each with the other's
  kvtransfer_endpoint_info list;
- lmdeploy/pytorch/disagg/{config,messages}.py, conn/protocol.py: the
  pydantic messages (tests/python/standin has models with their field
  lists; Debian's python3-pydantic);
- lmdeploy/pytorch/disagg/backend/{backend,__init__,mooncake}.py: the
  MIGRATION_BACKENDS registry (mmengine's Registry) and LMDeploy's own
  "Mooncake" registered when the package is imported.

Each engine is a process started with multiprocessing's 'spawn', as
LMDeploy's engine process and Ray workers are, and finds segxfer's backend
from its environment alone: SEGXFER_LMDEPLOY=Mooncake and segxfer.pth in a
site directory (here the user site of PYTHONUSERBASE; `make install` puts it
in dist-packages).  The test process does nothing to register it.

On a CUDA machine the same sequence runs on cuda:0 caches over cuda_ipc
(LMDeploy's NVLINK protocol) and staged TCP; here those cases skip.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from engine_proc import EngineProcess

pytest.importorskip("pydantic", reason="LMDeploy's messages are pydantic models "
                    "(make deps installs python3-pydantic)")
import lmdeploy_engine_proc as proc

STANDIN = os.path.join(ROOT, "tests", "python", "standin")
SEGXFER_CLASS = "segxfer.lmdeploy_backend.SegxferMigrationBackend"
LAYERS, UNIT = 4, 2 * 8 * 16 * 2          # K and V of 8 heads x 16 dims, fp16: bytes per block
PREFILL_BLOCKS, DECODE_BLOCKS = 48, 24     # unequal: the peer's layer stride matters
P_URL, D_URL = "http://127.0.0.1:23333", "http://127.0.0.1:23334"
CUDA = torch.cuda.is_available()


def site_env(tmp_path):
    """Environment settings under which a fresh interpreter processes
    segxfer.pth from a site directory of its own, as `make install` lays it
    out in dist-packages: the user site of a PYTHONUSERBASE, or, where the
    interpreter has no user site (a virtual environment), a sitecustomize
    on PYTHONPATH that adds the directory with site.addsitedir."""
    base = tmp_path / "userbase"
    probe = "import site; print(site.ENABLE_USER_SITE, site.getusersitepackages())"
    enabled, site = subprocess.run(
        [sys.executable, "-c", probe], env=dict(os.environ, PYTHONUSERBASE=str(base)),
        capture_output=True, text=True, check=True).stdout.split()
    if enabled != "True":
        site = str(tmp_path / "site")
    os.makedirs(site)
    for f in ("segxfer.pth", "_segxfer_hook.py"):
        shutil.copy(os.path.join(ROOT, "python", f), site)
    if enabled == "True":
        return {"PYTHONUSERBASE": str(base)}
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import site\nsite.addsitedir(%r)\n" % site)
    return {"PYTHONPATH": str(custom)}


@pytest.fixture
def engine_env(tmp_path, url, monkeypatch):
    """The environment LMDeploy's engine processes inherit: the hook's
    setting, the store and layout settings of the backend, and the
    stand-in LMDeploy on the path (spawn gives children the parent's
    sys.path)."""
    for k, v in site_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SEGXFER_LMDEPLOY", "Mooncake")
    monkeypatch.setenv("SX_METADATA_URL", url)
    monkeypatch.setenv("SEGXFER_NUM_LAYERS", str(LAYERS))
    monkeypatch.setenv("SEGXFER_DTYPE", "fp16")
    monkeypatch.setenv("SEGXFER_FINGERPRINT", "lmdeploy-test/v1")
    monkeypatch.syspath_prepend(STANDIN)
    return url


class Engine(EngineProcess):
    """A spawned engine process and the proxy's end of its pipe."""

    def __init__(self, blocks, device, seed=None):
        super().__init__(proc.main, LAYERS, blocks, UNIT, device, seed)

    def cache(self):
        return torch.frombuffer(bytearray(self.call("cache")), dtype=torch.uint8) \
            .view(LAYERS, -1, UNIT)


def engine_config(blocks):
    from lmdeploy.pytorch.disagg.config import DistServeEngineConfig
    return DistServeEngineConfig(tp_size=1, ep_size=1, dp_size=1, pp_size=None, dp_rank=0,
                                 block_size=64, num_cpu_blocks=0, num_gpu_blocks=blocks)


@pytest.mark.parametrize("device,protocol", [
    ("cpu", "TCP"),
    pytest.param("cuda:0", "NVLINK", marks=pytest.mark.skipif(not CUDA, reason="no CUDA")),
    pytest.param("cuda:0", "TCP", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))])
def test_lmdeploy_engine_sequence_migrates_bitwise(engine_env, device, protocol):
    from lmdeploy.pytorch.disagg.conn.protocol import (DistServeConnectionRequest,
                                                       DistServeEngineEndpointInfo,
                                                       DistServeInitRequest,
                                                       DistServeKVTransferEndpointInfo,
                                                       MigrationProtocol)
    from lmdeploy.pytorch.disagg.messages import MigrationExecutionBatch
    proto = MigrationProtocol[protocol]
    prefill = Engine(PREFILL_BLOCKS, device, seed=0x5EED)
    decode = Engine(DECODE_BLOCKS, device)
    try:
        # Found from the environment alone, in both spawned engines.
        for e in (prefill, decode):
            assert e.call("registered")["Mooncake"] == SEGXFER_CLASS
        # conn_worker, step 2: each engine's init request names the other.
        p_cfg, d_cfg = engine_config(PREFILL_BLOCKS), engine_config(DECODE_BLOCKS)
        p_init = DistServeInitRequest(protocol=proto, local_engine_id=P_URL,
                                      local_engine_config=p_cfg, remote_engine_id=D_URL,
                                      remote_engine_config=d_cfg)
        d_init = DistServeInitRequest(protocol=proto, local_engine_id=D_URL,
                                      local_engine_config=d_cfg, remote_engine_id=P_URL,
                                      remote_engine_config=p_cfg)
        # Each engine answers a list: one endpoint info per TP rank.
        p_infos = [prefill.call("init", proc.dump(p_init))]
        d_infos = [decode.call("init", proc.dump(d_init))]
        # Step 3: each engine connects with the other's list (p2p_connect
        # passes the backend conn_req[tp_rank]).
        for e, remote, infos in ((prefill, D_URL, d_infos), (decode, P_URL, p_infos)):
            e.call("connect", proc.dump(DistServeConnectionRequest(
                protocol=proto, remote_engine_id=remote,
                remote_engine_endpoint_info=DistServeEngineEndpointInfo(zmq_address="tcp://x:1"),
                remote_kvtransfer_endpoint_info=[proc.load(DistServeKVTransferEndpointInfo, i)
                                                 for i in infos])))
        # What CacheEngine.migrate reads from the link: the peer's blocks.
        link = decode.call("link", P_URL)
        assert link["remote_num_gpu_blocks"] == PREFILL_BLOCKS and link["rank"] == 0
        # LMDeploy's protocol picks the transport: TCP tcp, NVLINK cuda_ipc.
        assert link["transport"] == {"TCP": "tcp", "NVLINK": "cuda_ipc"}[protocol]
        # Two requests (sessions) from the prefill engine, block pairs
        # (remote, local), migrated as one assignment.
        reqs = [(P_URL, [(7, 0), (3, 5), (20, 6), (21, 7)]), (P_URL, [(47, 23), (0, 1)])]
        decode.call("migrate", proc.dump(MigrationExecutionBatch(protocol=proto, requests=reqs)))
        pc, dc = prefill.cache(), decode.cache()
        moved = {}
        for _, pairs in reqs:
            moved.update({local: remote for remote, local in pairs})
        for local in range(DECODE_BLOCKS):
            if local in moved:
                assert torch.equal(dc[:, local], pc[:, moved[local]]), local
            else:
                assert not dc[:, local].any(), local   # nothing else was written
        assert pc.any()
    finally:
        decode.stop()
        prefill.stop()


def test_lmdeploy_hook_only_with_the_setting(engine_env, monkeypatch):
    """Without SEGXFER_LMDEPLOY a spawned engine keeps LMDeploy's own
    backend; the hook replaces it only when asked to."""
    monkeypatch.delenv("SEGXFER_LMDEPLOY")
    e = Engine(4, "cpu")
    try:
        assert e.call("registered")["Mooncake"] == \
            "lmdeploy.pytorch.disagg.backend.mooncake.MooncakeBackend"
    finally:
        e.stop()


def start_python(site, code, extra_path=(), **env):
    """A fresh interpreter with the settings of site_env and env:
    (rc, stdout, stderr)."""
    full = dict(os.environ)
    full.pop("SEGXFER_LMDEPLOY", None)
    full.update(site)
    path = [*extra_path, os.path.join(ROOT, "python")]
    # The interpreter's own path comes last, as in an engine's environment
    # (where pydantic may live, as on the GPU machines).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full["PYTHONPATH"] = os.pathsep.join(path + ([site["PYTHONPATH"]] if "PYTHONPATH" in site
                                                 else []) + inherited)
    full.update(env)
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout.strip(), r.stderr.strip()


REGISTRY = ("from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS as R; "
            "m = R.module_dict; print(sorted(m), m['Mooncake'].__module__)")


def test_lmdeploy_hook_never_breaks_start_up(tmp_path):
    base = site_env(tmp_path)
    # No lmdeploy to import: nothing happens, not a word.
    assert start_python(base, "import sys; print('lmdeploy' in sys.modules)",
                        SEGXFER_LMDEPLOY="Mooncake") == (0, "False", "")
    rc, out, err = start_python(base, "import lmdeploy", SEGXFER_LMDEPLOY="Mooncake")
    assert rc == 1 and "No module named 'lmdeploy'" in err and "segxfer" not in err
    # Values that are no backend name: a clear warning, the start goes on,
    # LMDeploy keeps its own.
    for bad in ("", "Moon cake", "../x", "Mooncake;rm"):
        rc, out, err = start_python(base, REGISTRY, [STANDIN], SEGXFER_LMDEPLOY=bad)
        assert rc == 0 and out == "['Mooncake'] lmdeploy.pytorch.disagg.backend.mooncake", bad
        assert err == "segxfer: SEGXFER_LMDEPLOY=%r is not a backend name (e.g. Mooncake, " \
            "the value of LMDeploy's --migration-backend): segxfer's backend is not " \
            "registered" % bad
    # A name LMDeploy never asks for: registered, and said so.
    rc, out, err = start_python(base, REGISTRY, [STANDIN], SEGXFER_LMDEPLOY="Segxfer")
    assert rc == 0 and out == "['Mooncake', 'Segxfer'] lmdeploy.pytorch.disagg.backend.mooncake"
    assert "LMDeploy asks for one of DLSlime, Mooncake (--migration-backend), never for " \
        "'Segxfer'" in err
    # segxfer's library missing: LMDeploy still imports; building the
    # backend (p2p_initialize) says why.
    code = REGISTRY + "\ntry:\n    m['Mooncake']()\nexcept ImportError as e:\n    print(e)"
    rc, out, err = start_python(base, code, [STANDIN], SEGXFER_LMDEPLOY="Mooncake",
                                SEGXFER_LIB=str(tmp_path / "nowhere.so"))
    assert rc == 0 and err == "", err
    assert out.splitlines()[0] == "['Mooncake'] _segxfer_hook"
    assert out.splitlines()[1].startswith("SEGXFER_LMDEPLOY=Mooncake: the segxfer package "
                                          "cannot be loaded (ImportError: segxfer: cannot load")
