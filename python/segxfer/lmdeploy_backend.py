"""A KV-cache migration backend in the shape of LMDeploy's
(lmdeploy/pytorch/disagg/backend/base.py: MigrationBackendImpl), over
segxfer, without importing LMDeploy.

LMDeploy's Mooncake backend runs in P2PHANDSHAKE mode: each engine reports
`ip:port` plus the raw addresses of its memory regions in endpoint_info, the
proxy relays that to the peer, and the peer reads raw addresses.  This
backend publishes the engine's cache as a named segment in the metadata store
instead: endpoint_info is the segment's name (and the namespace to find it
in), p2p_connect opens the peer by that name and checks its layout before any
byte moves, and p2p_migrate runs the whole assignment as one batched read.

The messages are duck-typed: any object with the fields LMDeploy's pydantic
models have works (DistServeInitRequest: local_engine_id, remote_engine_id,
local_engine_config.num_gpu_blocks, protocol, rank;
DistServeRegisterMRMessage: remote_engine_id, mr_key, addr, offset, length;
DistServeKVTransferEndpointInfo: protocol, endpoint_info (JSON text);
MigrationAssignment: remote_engine_id, batch of AssignmentInstruct: mr_key,
target_offset (in the peer's region), source_offset (in ours), length).

Plugging it into LMDeploy: LMDeploy builds the backend by name inside its
engine process (spawned, and in Ray workers for TP > 1) with no arguments,
so the settings come from the environment (see SegxferMigrationBackend) and
so does the registration: with the package installed (`make install` puts
segxfer.pth beside it), SEGXFER_LMDEPLOY=Mooncake registers this class as
LMDeploy's "Mooncake" backend in every interpreter that imports LMDeploy
(_segxfer_hook.py; docs/engines.md).
"""
import json
import os
import re
from urllib.parse import parse_qsl, urlsplit

from .agent import Agent, serving_transports
from .batch import _index, _u64
from .errors import code, error, invalid


def _name_part(text):
    """Text made safe for a segment name ([A-Za-z0-9._:/@+=-])."""
    return re.sub(r"[^A-Za-z0-9._:/@+=-]", "_", str(text)).strip("/") or "_"


def store_without_secrets(url):
    """(store, namespace): the URL's scheme, hosts and db without user,
    password or other query items, and its namespace ("default" when unset)."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    ns = dict(parse_qsl(parts.query)).get("namespace", "default")
    return "%s://%s%s" % (parts.scheme, hosts, parts.path), ns


def _field(obj, name, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


class _Link:
    """One peer engine, as LMDeploy's own backends keep it in `links`
    (MooncakeMigrationManagement, DLSlimeMigrationManagement): LMDeploy's
    CacheEngine.migrate reads links[remote_engine_id].remote_engine_config
    .num_gpu_blocks to compute the peer's layer stride, so the fields it and
    those links carry keep their names here."""
    __slots__ = ("remote_engine_id", "local_engine_id", "rank", "local_engine_config",
                 "remote_engine_config", "segment", "remote_regions")

    def __init__(self, init_request):
        self.remote_engine_id = _field(init_request, "remote_engine_id")
        self.local_engine_id = _field(init_request, "local_engine_id")
        self.rank = _field(init_request, "rank")
        self.local_engine_config = _field(init_request, "local_engine_config")
        self.remote_engine_config = _field(init_request, "remote_engine_config")
        self.segment = None
        self.remote_regions = {}  # mr_key -> region id in the peer's segment


class SegxferMigrationBackend:
    """LMDeploy's MigrationBackendImpl over segxfer.

    One agent per process (per engine rank), made by the first
    p2p_initialize, publishing the segment <prefix>/<local_engine_id>/rank<rank>.
    Each memory region (mr_key) is registered once and published as group
    mr_key.  Arguments, each with an environment fallback (LMDeploy passes
    none):

    metadata_url   $SX_METADATA_URL (required)
    prefix         $SEGXFER_PREFIX, default "lmdeploy"
    transports     $SEGXFER_TRANSPORTS (e.g. "tcp"), default: from the
                   request's protocol (TCP: tcp; otherwise auto)
    num_layers     $SEGXFER_NUM_LAYERS: the cache is [num_layers,
                   num_gpu_blocks, bytes per block] and is then described
                   block by block (readable by block id, e.g. with sxctl);
                   without it a region is num_gpu_blocks units of
                   length/num_gpu_blocks bytes, which checks the block size
                   summed over layers but not where each layer's part lies
    fingerprint, dtype, tag   $SEGXFER_FINGERPRINT, $SEGXFER_DTYPE,
                   $SEGXFER_TAG: the layout peers must agree with
    open_timeout   seconds p2p_connect waits for the peer's segment (10)
    migrate_timeout  deadline of one migration (30)
    async_migration  $SEGXFER_ASYNC_MIGRATION=1: p2p_migrate without
                   async_op returns at once too (the caller awaits it)
    agent_kw       more Agent arguments (lease_ms, listen, advertise, ...)
    """

    def __init__(self, metadata_url=None, *, prefix=None, transports=None,
                 num_layers=None, fingerprint=None, dtype=None, tag=None,
                 open_timeout=10.0, migrate_timeout=30.0, async_migration=None,
                 **agent_kw):
        env = os.environ
        self.metadata_url = metadata_url or env.get("SX_METADATA_URL")
        self.prefix = prefix or env.get("SEGXFER_PREFIX", "lmdeploy")
        self.transports = transports or env.get("SEGXFER_TRANSPORTS")
        layers = num_layers if num_layers is not None else env.get("SEGXFER_NUM_LAYERS")
        self.num_layers = None
        if layers not in (None, ""):
            # 0 was taken as "not given", a negative count reached the agent,
            # and text that is not a number raised int()'s bare ValueError.
            n = (int(layers) if layers.strip().isdigit() else None) \
                if isinstance(layers, str) else _index(layers)
            if n is None or n < 1:
                raise invalid("num_layers (SEGXFER_NUM_LAYERS) must be a positive integer "
                              "(got %r)" % (layers,))
            self.num_layers = n
        self.layout = dict(fingerprint=fingerprint or env.get("SEGXFER_FINGERPRINT", ""),
                           dtype=dtype or env.get("SEGXFER_DTYPE", ""),
                           tag=tag or env.get("SEGXFER_TAG", ""))
        self.open_timeout, self.migrate_timeout = open_timeout, migrate_timeout
        if async_migration is None:
            async_migration = env.get("SEGXFER_ASYNC_MIGRATION", "") not in ("", "0")
        self.async_migration = async_migration
        self.agent_kw = agent_kw
        self.agent = None
        self.segment_name = None
        self.num_blocks = None
        self.local_mrs = {}  # mr_key -> (addr, length)
        self.links = {}      # remote_engine_id -> _Link

    # ------------------------------------------------------------ our side

    def p2p_initialize(self, init_request):
        """Start this engine's agent (first call) and remember the link."""
        remote = _field(init_request, "remote_engine_id")
        cfg = _field(init_request, "local_engine_config")
        blocks = _field(cfg, "num_gpu_blocks")
        if _field(_field(init_request, "remote_engine_config"), "num_gpu_blocks") is None:
            # CacheEngine.migrate needs it for the peer's layer stride.
            raise invalid("p2p_initialize: the request's remote_engine_config has no "
                          "num_gpu_blocks")
        if self.agent is None:
            if not self.metadata_url:
                raise invalid("SegxferMigrationBackend: no metadata URL (pass "
                              "metadata_url or set SX_METADATA_URL)")
            rank = _field(init_request, "rank") or 0
            self.segment_name = "%s/%s/rank%d" % (
                _name_part(self.prefix), _name_part(_field(init_request, "local_engine_id")),
                rank)
            transports = self.transports
            if transports is None:
                transports = self._transports_for(_field(init_request, "protocol"))
            self.agent = Agent(self.segment_name, self.metadata_url,
                               transports=serving_transports(transports),
                               **self.layout, **self.agent_kw)
            self.num_blocks = blocks
        elif blocks is not None and self.num_blocks is not None and blocks != self.num_blocks:
            raise invalid("p2p_initialize: num_gpu_blocks %d differs from the %d of the "
                          "first link" % (blocks, self.num_blocks))
        # A second initialize for the same peer (the proxy reconnects after
        # the peer restarted) replaces the link, as LMDeploy's backends do:
        # its config (num_gpu_blocks) may have changed.
        self.p2p_drop_connect(remote)
        self.links[remote] = _Link(init_request)

    def register_memory_region(self, register_mr_request):
        """Register (once per mr_key; LMDeploy calls it for every link) and
        publish."""
        if self.agent is None:
            raise invalid("register_memory_region before p2p_initialize")
        mr_key = self._mr_key(_field(register_mr_request, "mr_key"))
        addr = _field(register_mr_request, "addr")
        length = _field(register_mr_request, "length")
        if mr_key in self.local_mrs:
            if self.local_mrs[mr_key] != (addr, length):
                raise invalid("mr_key %d is registered already with other memory" % mr_key)
            return
        blocks = self.num_blocks or 1
        layers = self.num_layers or 1
        if length % (blocks * layers):
            raise invalid("mr_key %d: length %d is not num_layers %d x num_gpu_blocks %d "
                          "blocks" % (mr_key, length, layers, blocks))
        # addr is the region's start (LMDeploy's `offset` is the tensor's
        # storage offset, already part of data_ptr()).
        self.agent.register(addr=addr, length=length, group=mr_key, layers=layers,
                            layer_stride=length // layers if layers > 1 else 0,
                            slot=0, block_bytes=length // (layers * blocks),
                            num_blocks=blocks, location=self._location(register_mr_request))
        self.local_mrs[mr_key] = (addr, length)
        self.agent.publish()

    def endpoint_info(self, remote_engine_id, protocol=None):
        """What the peer needs to find this engine: the segment's name, the
        store and namespace it is published in (no credentials), and the
        incarnation (so a restart in between is noticed).  No address."""
        if self.agent is None:
            raise invalid("endpoint_info before p2p_initialize")
        store, ns = store_without_secrets(self.metadata_url)
        return {"segment": self.segment_name, "store": store, "namespace": ns,
                "incarnation": self.agent.incarnation,
                "mr_keys": sorted(self.local_mrs)}

    # ------------------------------------------------------------ the peer

    def p2p_connect(self, remote_engine_id, conn_req):
        """Open the peer's segment by name and check its layout (raises
        IncompatibleLayout before anything is read)."""
        link = self.links.get(remote_engine_id)
        if link is None:
            raise invalid("p2p_connect: no p2p_initialize for %r" % (remote_engine_id,))
        info = _field(conn_req, "endpoint_info", conn_req)
        if isinstance(info, (str, bytes)):
            try:
                info = json.loads(info)
            except ValueError as e:
                raise invalid("p2p_connect: the endpoint info is not JSON (%s)" % e) from None
        if not isinstance(info, dict) or not isinstance(info.get("segment"), str):
            raise invalid("p2p_connect: the endpoint info has no segment name (what the "
                          "peer's endpoint_info() returns): %r" % (info,))
        _, ns = store_without_secrets(self.metadata_url)
        if info.get("namespace", ns) != ns:
            raise invalid("the peer publishes in namespace %r, this engine uses %r"
                          % (info.get("namespace"), ns))
        seg = self.agent.open(info["segment"], timeout=self.open_timeout)
        try:
            desc = seg.descriptor()
            if info.get("incarnation") and desc["incarnation"] != info["incarnation"]:
                raise error(code("SX_ESTALE"),
                            "%s restarted since it sent its endpoint info (incarnation %s, "
                            "now %s)" % (info["segment"], info["incarnation"][:8],
                                         desc["incarnation"][:8]))
            seg.check()
            regions = {r["group"]: r["id"] for r in seg.regions()}
        except BaseException:
            seg.close()
            raise
        if link.segment is not None:
            link.segment.close()
        link.segment, link.remote_regions = seg, regions

    def p2p_migrate(self, assignment, async_op=False):
        """Read the assignment's ranges (peer region mr_key at
        target_offset -> our region mr_key at source_offset) as one batch.

        Returns the Batch.  async_op False: it has ended (the call waited
        and raised if it failed); `await` on it returns at once, as
        LMDeploy's `await backend.p2p_migrate(...)` does.  async_op True: it
        runs; `await` it (the loop stays free) or wait() for it."""
        link = self.links.get(_field(assignment, "remote_engine_id"))
        if link is None or link.segment is None:
            raise invalid("p2p_migrate: not connected to %r (p2p_connect first)"
                          % (_field(assignment, "remote_engine_id"),))
        tasks = _field(assignment, "batch")
        if isinstance(tasks, (str, bytes)) or not hasattr(tasks, "__iter__"):
            raise invalid("p2p_migrate: the assignment's batch must be a list of tasks "
                          "(got %r)" % (tasks,))
        tasks = list(tasks)
        packed = self._pack(tasks, link)
        batch = link.segment.batch(timeout=self.migrate_timeout)
        try:
            batch._add_packed_ranges(packed, len(tasks))
            batch.submit()
        except BaseException:
            batch.close()
            raise
        if not (async_op or self.async_migration):
            batch.wait()
            batch.result().raise_for_state()
        return batch

    def _pack(self, tasks, link):
        import array
        packed = array.array("Q", bytes(32 * len(tasks)))
        for i, t in enumerate(tasks):
            mr_key = self._mr_key(_field(t, "mr_key"))
            local = self.local_mrs.get(mr_key)
            region = link.remote_regions.get(mr_key)
            if local is None or region is None:
                raise invalid("task %d: mr_key %d is not registered %s" % (
                    i, mr_key, "here" if local is None else "by the peer"))
            # Integers of any kind (an engine's numpy offsets too); a value
            # outside 0 .. 2**64-1 is SX_EINVAL, not an OverflowError.
            src = _u64(_field(t, "source_offset"), "task %d: source_offset" % i)
            length = _u64(_field(t, "length"), "task %d: length" % i)
            dst = _u64(_field(t, "target_offset"), "task %d: target_offset" % i)
            if length == 0 or src + length > local[1]:
                raise error(code("SX_EBOUNDS"), "task %d: source_offset %r + length %r "
                            "outside the %d bytes of local mr_key %d"
                            % (i, src, length, local[1], mr_key))
            packed[4 * i:4 * i + 4] = array.array("Q", (local[0] + src, region, dst, length))
        return packed

    def p2p_drop_connect(self, remote_engine_id):
        link = self.links.pop(remote_engine_id, None)
        if link is not None and link.segment is not None:
            link.segment.close()

    def store(self, assignment, async_op=False):
        raise NotImplementedError("segxfer migrates between engines only")

    def load(self, assignment, async_op=False):
        raise NotImplementedError("segxfer migrates between engines only")

    def close(self):
        """Close every link and the agent (the segment is unpublished)."""
        for remote in list(self.links):
            self.p2p_drop_connect(remote)
        if self.agent is not None:
            self.agent.close()

    @staticmethod
    def _mr_key(mr_key):
        try:
            k = int(mr_key)
        except (TypeError, ValueError):
            raise invalid("mr_key %r is not an integer" % (mr_key,)) from None
        if not 0 <= k < 2**32:
            raise invalid("mr_key %r is out of range" % (mr_key,))
        return k

    @staticmethod
    def _transports_for(protocol):
        """LMDeploy's MigrationProtocol as segxfer transports: TCP is tcp,
        NVLINK (peers on one host's GPUs) is cuda_ipc (with tcp, whose
        connection carries its handles), RDMA is the library's choice (RDMA
        where both sides have it)."""
        name = getattr(protocol, "name", str(protocol)).upper().rpartition(".")[2]
        return {"TCP": "tcp", "NVLINK": "cuda_ipc,tcp"}.get(name, "auto")

    @staticmethod
    def _location(msg):
        """The message's own location if it has one (LMDeploy's has not;
        then the driver is asked about the address), else $SEGXFER_LOCATION."""
        loc = _field(msg, "location") or os.environ.get("SEGXFER_LOCATION")
        return loc if isinstance(loc, str) and loc else None
