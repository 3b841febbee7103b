"""SGLang's disaggregation classes that segxfer.sglang builds on: the real
ones when SGLang is importable, else a local stand-in of the parts used,
with SGLang's names, signatures and message shapes.

Read from sgl-project/sglang, python/sglang/srt/disaggregation/:
  base/conn.py    KVArgs, KVPoll, BaseKVManager/Sender/Receiver   (0094505d)
  common/conn.py  CommonKVManager, CommonKVSender, CommonKVReceiver,
                  CommonKVBootstrapServer, KVTransferError          (0094505d)
  utils.py        DisaggregationMode, TransferBackend, get_kv_class (000eaffa)

What the stand-in keeps of SGLang (so that the adapter runs the same code
paths with or without it):
- the bootstrap server's HTTP routes: PUT /route (a prefill rank registers
  rank_ip, rank_port, tp/dp/pp sizes, page size, kv dtype), GET /route with
  prefill_dp_rank/prefill_cp_rank/target_tp_rank/target_pp_rank (-1 for all:
  the prefill's parallel info, 503 until every rank registered), GET /health;
- the side channel: each manager binds one PULL socket (rank_port) and sends
  multipart messages to its peers' PULL sockets with PUSH sockets; ABORT
  frames [b"ABORT", room, ip, port] as CommonKVReceiver sends them;
- request_status with update_status's rules (Failed sticks, otherwise the
  state only moves forward), failure_records, the bootstrap and waiting
  deadlines (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and
  SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s by default), the decode
  side's rank mapping (_resolve_rank_mapping), connection_pool keyed as
  SGLang keys it, and the order CommonKVReceiver.init runs in.
What it leaves out: CP, DCP, staging buffers, the prefill-dp-rank routes,
the decode heartbeat thread (its /health polling), and torch.distributed;
attn_tp_size and ranks come from server_args (tp_size, dp_size,
enable_dp_attention) instead of SGLang's get_parallel().

The side channel uses pyzmq where it is installed (Debian: python3-zmq), as
SGLang does; where it is not (SEGXFER_SGLANG_WIRE=socket forces this), the
same PUSH/PULL multipart messages over plain TCP (_SocketWire).  Set
SEGXFER_SGLANG_STANDIN=1 to use the stand-in although SGLang is installed.
"""
import dataclasses
import enum
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("segxfer.sglang")


def load():
    """The classes segxfer.sglang derives from, as a namespace: SGLang's own
    when it imports (real=True), else this module's stand-in."""
    if os.environ.get("SEGXFER_SGLANG_STANDIN", "") in ("", "0"):
        try:
            return _real()
        except ImportError:
            pass
    return types.SimpleNamespace(
        real=False, KVArgs=KVArgs, KVPoll=KVPoll, KVTransferError=KVTransferError,
        DisaggregationMode=DisaggregationMode, CommonKVManager=CommonKVManager,
        CommonKVSender=CommonKVSender, CommonKVReceiver=CommonKVReceiver,
        CommonKVBootstrapServer=CommonKVBootstrapServer, wire_errors=_wire_errors())


def _real():
    from sglang.srt.disaggregation.base import conn as base
    from sglang.srt.disaggregation.common import conn as common
    from sglang.srt.disaggregation import utils
    return types.SimpleNamespace(
        real=True, KVArgs=base.KVArgs, KVPoll=base.KVPoll,
        KVTransferError=common.KVTransferError, DisaggregationMode=utils.DisaggregationMode,
        CommonKVManager=common.CommonKVManager, CommonKVSender=common.CommonKVSender,
        CommonKVReceiver=common.CommonKVReceiver,
        CommonKVBootstrapServer=common.CommonKVBootstrapServer, wire_errors=_wire_errors())


# ------------------------------------------------------------ base/conn.py


class KVArgs:
    """The buffers of one engine rank (base/conn.py KVArgs): the fields the
    adapter reads, set by the engine as attributes."""
    engine_rank = 0
    kv_data_ptrs, kv_data_lens, kv_item_lens = [], [], []
    aux_data_ptrs, aux_data_lens, aux_item_lens = [], [], []
    state_types, state_data_ptrs, state_data_lens, state_item_lens = [], [], [], []
    ib_device = None
    gpu_id = 0
    kv_head_num = total_kv_head_num = 0
    page_size = 1
    system_dp_rank = 0
    pp_rank = 0
    prefill_start_layer = 0


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(Exception):
    def __init__(self, bootstrap_room, failure_reason, is_from_another_rank=False):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self):
        return "KVTransferError(bootstrap_room=%s): %s" % (self.bootstrap_room,
                                                          self.failure_reason)


# ------------------------------------------------------------ the side channel


def _zmq():
    if os.environ.get("SEGXFER_SGLANG_WIRE") == "socket":
        return None
    try:
        import zmq
        return zmq
    except ImportError:
        return None


def _wire_errors():
    """What a side-channel send raises when the peer cannot take it."""
    zmq = _zmq()
    return (OSError, zmq.ZMQError) if zmq is not None else (OSError,)


def wire_name():
    return "zmq" if _zmq() is not None else "socket"


class _SocketPull:
    """A PULL socket's stand-in: accepts PUSH connections and queues the
    multipart messages they send (frames: u32 count, then u32 length + bytes
    each, network order)."""

    def __init__(self, host):
        self._q = queue.Queue()
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, 0))
        self._lsock.listen(64)
        self.port = self._lsock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="sx-sglang-pull").start()

    def _accept(self):
        while not self._closed:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    @staticmethod
    def _exact(conn, n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _read(self, conn):
        with conn:
            try:
                while True:
                    (count,) = struct.unpack("!I", self._exact(conn, 4))
                    if count > 64:
                        return      # not one of ours
                    frames = []
                    for _ in range(count):
                        (length,) = struct.unpack("!I", self._exact(conn, 4))
                        if length > 1 << 30:
                            return
                        frames.append(self._exact(conn, length))
                    self._q.put(frames)
            except (EOFError, OSError):
                return

    def poll(self, timeout_ms):
        try:
            self._head = self._q.get(timeout=timeout_ms / 1000.0)
            return True
        except queue.Empty:
            return False

    def recv_multipart(self):
        head = getattr(self, "_head", None)
        if head is not None:
            self._head = None
            return head
        return self._q.get()

    def close(self, linger=0):
        self._closed = True
        self._lsock.close()


class _SocketPush:
    def __init__(self, endpoint):
        host, _, port = endpoint.replace("tcp://", "").rpartition(":")
        self._addr = (host.strip("[]"), int(port))
        self._sock = None

    def send_multipart(self, frames):
        if self._sock is None:
            self._sock = socket.create_connection(self._addr, timeout=5)
        out = [struct.pack("!I", len(frames))]
        for f in frames:
            out += [struct.pack("!I", len(f)), bytes(f)]
        try:
            self._sock.sendall(b"".join(out))
        except OSError:
            self.close()
            raise

    def close(self, linger=0):
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _ZmqPull:
    """zmq's PULL socket with the poll/recv pair the adapter's threads use."""

    def __init__(self, ctx, host):
        zmq = _zmq()
        self._sock = ctx.socket(zmq.PULL)
        self.port = self._sock.bind_to_random_port("tcp://%s" % host)

    def poll(self, timeout_ms):
        return bool(self._sock.poll(timeout_ms))

    def recv_multipart(self):
        return self._sock.recv_multipart()

    def close(self, linger=0):
        self._sock.close(linger=linger)


def bind_pull(host, ctx=None):
    """(port, socket): a PULL socket bound to a free port of host."""
    zmq = _zmq()
    if zmq is not None:
        s = _ZmqPull(ctx or zmq.Context.instance(), host)
    else:
        s = _SocketPull(host)
    return s.port, s


def connect_push(endpoint, ctx=None):
    zmq = _zmq()
    if zmq is None:
        return _SocketPush(endpoint)
    s = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 30000)
    s.connect(endpoint)
    return s


def tcp_endpoint(ip, port):
    return "tcp://[%s]:%d" % (ip, port) if ":" in ip else "tcp://%s:%d" % (ip, port)


# ------------------------------------------------------------ HTTP


def _http(method, url, body=None, timeout=5):
    """(status, text) of an HTTP request; status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


def _env_float(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return float(default)


# ------------------------------------------------------------ common/conn.py


@dataclasses.dataclass
class PrefillServerInfo:
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int = None
    kv_cache_dtype: str = None
    follow_bootstrap_room: bool = True
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int = None
    target_tp_rank: int = None
    target_tp_ranks: list = None
    target_cp_ranks: list = None
    target_pp_ranks: list = None
    required_dst_info_num: int = None
    required_prefill_response_num: int = None


class CommonKVManager:
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.kv_item_lens_sum = sum(args.kv_item_lens)
        self.is_mla_backend = is_mla_backend
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.bootstrap_host = server_args.host
        self.bootstrap_port = server_args.disaggregation_bootstrap_port
        self.dist_init_addr = getattr(server_args, "dist_init_addr", None)
        dp = getattr(server_args, "dp_size", 1) or 1
        attn_dp = dp if getattr(server_args, "enable_dp_attention", False) else 1
        self.attn_tp_size = server_args.tp_size // attn_dp
        self.attn_tp_rank = args.engine_rank % self.attn_tp_size
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.attn_dp_size = attn_dp
        self.attn_dp_rank = args.engine_rank // self.attn_tp_size if attn_dp > 1 else 0
        self.system_dp_size = 1 if attn_dp > 1 else dp
        self.system_dp_rank = args.system_dp_rank or 0
        self.pp_size = getattr(server_args, "pp_size", 1) or 1
        self.pp_rank = args.pp_rank
        self.local_ip = os.environ.get("SGLANG_HOST_IP", "127.0.0.1")
        self.is_dummy_cp_rank = False
        self.enable_all_cp_ranks_for_transfer = False
        self.rank_port, self.server_socket = bind_pull(self.local_ip)
        self.request_status = {}
        self._socket_cache = {}
        self._socket_lock = threading.Lock()
        self.failure_records = {}
        self.failure_lock = threading.Lock()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()
            self.transfer_infos = {}
            self.req_to_decode_prefix_len = {}
            self.decode_kv_args_table = {}
            self.bootstrap_timeout = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self.enable_staging = False
            self.connection_pool = {}
            self.connection_lock = threading.Lock()
            self.required_prefill_response_num_table = {}
            self.prefill_info_table = {}
            self.addr_to_rooms_tracker = {}
            self.prefill_response_tracker = {}
            self.waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        else:
            raise ValueError("Unsupported DisaggregationMode: %s" % disaggregation_mode)

    def check_status(self, bootstrap_room):
        return self.request_status[bootstrap_room]

    def update_status(self, bootstrap_room, status):
        if bootstrap_room not in self.request_status:
            if status == KVPoll.Failed:
                return      # a cleared room is not brought back as Failed
            self.request_status[bootstrap_room] = status
        elif status == KVPoll.Failed:
            self.request_status[bootstrap_room] = KVPoll.Failed
        else:
            self.request_status[bootstrap_room] = max(self.request_status[bootstrap_room],
                                                      status)

    def record_failure(self, bootstrap_room, failure_reason):
        with self.failure_lock:
            self.failure_records[bootstrap_room] = failure_reason

    def register_to_bootstrap(self):
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host,
                                                          self.bootstrap_host)
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": self.local_ip, "rank_port": self.rank_port,
            "page_size": self.kv_args.page_size,
            "kv_cache_dtype": getattr(self.server_args, "kv_cache_dtype", None),
        }
        url = "http://%s:%d/route" % (host, self.bootstrap_port)
        for attempt in range(5):
            status, text = _http("PUT", url, payload)
            if status == 200:
                return
            logger.warning("prefill register attempt %d/5 failed: %s %s", attempt + 1,
                           status, text)
            time.sleep(0.2 * 2 ** attempt)
        logger.error("prefill rank failed to register to the bootstrap server at %s", url)

    def try_ensure_parallel_info(self, bootstrap_addr):
        if bootstrap_addr in self.prefill_info_table:
            return True
        status, text = _http("GET", "http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                             "&target_tp_rank=-1&target_pp_rank=-1" % bootstrap_addr)
        if status != 200:
            logger.error("failed to get prefill server info: %s %s", status, text)
            return False
        info = PrefillServerInfo(**json.loads(text))
        if info.page_size is not None and info.page_size != self.kv_args.page_size:
            raise RuntimeError("Page size mismatch: prefill server has page_size=%s, but "
                               "decode server has page_size=%s." % (info.page_size,
                                                                   self.kv_args.page_size))
        self._resolve_rank_mapping(info)
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def _resolve_rank_mapping(self, info):
        rank = self.kv_args.engine_rank % self.attn_tp_size
        if self.attn_tp_size == info.attn_tp_size:
            target, ranks, dst_num, resp_num = rank, [rank], 1, 1
        elif self.attn_tp_size > info.attn_tp_size:
            target = rank // (self.attn_tp_size // info.attn_tp_size)
            ranks, dst_num, resp_num = [target], self.attn_tp_size // info.attn_tp_size, 1
        else:
            ratio = info.attn_tp_size // self.attn_tp_size
            ranks = list(range(rank * ratio, (rank + 1) * ratio))
            target, dst_num = ranks[0], 1
            resp_num = 1 if self.is_mla_backend else ratio
        info.target_tp_rank, info.target_tp_ranks = target, ranks
        info.target_cp_ranks = [0]
        info.target_pp_ranks = [self.pp_rank] if info.pp_size == self.pp_size else \
            list(range(info.pp_size))
        info.required_dst_info_num = dst_num
        info.required_prefill_response_num = resp_num

    def _connect(self, endpoint, is_ipv6=False):
        with self._socket_lock:
            sock = self._socket_cache.get(endpoint)
            if sock is None:
                sock = self._socket_cache[endpoint] = connect_push(endpoint)
            return sock


def _fake_failure_exception(self):
    """The common classes' placeholder (backends override it)."""
    raise Exception("Fake KVReceiver Exception")


def _aborted(end):
    """What CommonKVSender.abort and CommonKVReceiver.abort both do first."""
    end.kv_mgr.record_failure(end.bootstrap_room, "Aborted by AbortReq.")
    end.kv_mgr.update_status(end.bootstrap_room, KVPoll.Failed)
    end.conclude_state = KVPoll.Failed


class CommonKVSender:
    def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank,
                 req_has_disagg_prefill_dp_rank=False):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.aux_index = None
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state = None
        self.curr_idx = 0
        self.init_time = None
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def init(self, num_kv_indices, aux_index=None):
        self.num_kv_indices = num_kv_indices
        self.aux_index = aux_index

    def pop_decode_prefix_len(self):
        return self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, 0)

    def should_send_kv_chunk(self, num_pages, last_chunk):
        return num_pages > 0 or last_chunk

    def _prepare_send_indices(self, kv_indices, state_indices=None):
        index_slice = slice(self.curr_idx, self.curr_idx + len(kv_indices))
        self.curr_idx += len(kv_indices)
        is_last_chunk = self.curr_idx == self.num_kv_indices
        return kv_indices, index_slice, is_last_chunk, False

    def _check_bootstrap_timeout(self):
        if self.init_time is None:
            return None
        elapsed = time.time() - self.init_time
        if elapsed < self.kv_mgr.bootstrap_timeout:
            return None
        self.kv_mgr.record_failure(self.bootstrap_room, "Request %s timed out after %.1fs "
                                   "in KVPoll.Bootstrapping" % (self.bootstrap_room, elapsed))
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        return KVPoll.Failed

    failure_exception = _fake_failure_exception

    def clear(self):
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)
        self.kv_mgr.transfer_infos.pop(self.bootstrap_room, None)

    def abort(self):
        _aborted(self)


class CommonKVReceiver:
    _socket_cache = {}
    _socket_locks = {}
    _global_lock = threading.Lock()

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.kv_mgr = mgr
        self.conclude_state = None
        self.require_staging = False
        self.init_time = None
        self.abort_notified = False
        self.kv_mgr.addr_to_rooms_tracker.setdefault(bootstrap_addr, set()).add(bootstrap_room)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank):
        if self.bootstrap_addr not in self.kv_mgr.prefill_info_table:
            self.kv_mgr.record_failure(
                self.bootstrap_room, "Prefill server with bootstrap_addr: %s is healthy "
                "before, but now it is down. Request (bootstrap_room: %s) has been marked "
                "as failed." % (self.bootstrap_addr, self.bootstrap_room))
            self.conclude_state = KVPoll.Failed
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        self.prefill_info = self.kv_mgr.prefill_info_table[self.bootstrap_addr]
        self.target_tp_rank = self.prefill_info.target_tp_rank
        self.target_tp_ranks = self.prefill_info.target_tp_ranks
        self.target_cp_ranks = self.prefill_info.target_cp_ranks
        self.target_pp_ranks = self.prefill_info.target_pp_ranks
        self.required_dst_info_num = self.prefill_info.required_dst_info_num
        self.required_prefill_response_num = self.prefill_info.required_prefill_response_num
        self.kv_mgr.required_prefill_response_num_table[self.bootstrap_room] = \
            self.required_prefill_response_num
        self.prefill_dp_rank = prefill_dp_rank
        self._setup_bootstrap_infos()
        if self.conclude_state == KVPoll.Failed:
            return
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)

    def _setup_bootstrap_infos(self):
        all_infos = []
        for cp_rank in self.target_cp_ranks:
            key = "%s_%s_%s_%s" % (self.bootstrap_addr, self.prefill_dp_rank, cp_rank,
                                   self.target_tp_rank)
            if key not in self.kv_mgr.connection_pool:
                infos = []
                for tp_rank in self.target_tp_ranks:
                    for pp_rank in reversed(self.target_pp_ranks):
                        info = self._get_bootstrap_info_from_server(
                            self.prefill_dp_rank, cp_rank, tp_rank, pp_rank)
                        if info is None:
                            self.kv_mgr.record_failure(
                                self.bootstrap_room, "Could not fetch bootstrap info for: "
                                "prefill_dp_rank: %s prefill_cp_rank: %s target_tp_rank: %s "
                                "and target_pp_rank %s" % (self.prefill_dp_rank, cp_rank,
                                                           tp_rank, pp_rank))
                            self.conclude_state = KVPoll.Failed
                            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                            self.bootstrap_infos = None
                            return
                        info["is_dummy"] = False
                        infos.append(info)
                self.bootstrap_infos = infos
                self.kv_mgr.connection_pool[key] = infos
                self._register_kv_args()
            else:
                self.bootstrap_infos = self.kv_mgr.connection_pool[key]
            all_infos.extend(self.bootstrap_infos)
        self.bootstrap_infos = all_infos

    def _get_bootstrap_info_from_server(self, prefill_dp_rank, prefill_cp_rank,
                                        target_tp_rank, target_pp_rank):
        status, text = _http("GET", "http://%s/route?prefill_dp_rank=%s&prefill_cp_rank=%s"
                             "&target_tp_rank=%s&target_pp_rank=%s"
                             % (self.bootstrap_addr, prefill_dp_rank, prefill_cp_rank,
                                target_tp_rank, target_pp_rank))
        if status != 200:
            logger.error("failed to get prefill server info: %s %s", status, text)
            return None
        return json.loads(text)

    @classmethod
    def _connect(cls, endpoint, is_ipv6=False):
        with cls._global_lock:
            if endpoint not in cls._socket_cache:
                cls._socket_cache[endpoint] = connect_push(endpoint)
                cls._socket_locks[endpoint] = threading.Lock()
            return cls._socket_cache[endpoint], cls._socket_locks[endpoint]

    @classmethod
    def _connect_to_bootstrap_server(cls, bootstrap_info):
        return cls._connect(tcp_endpoint(bootstrap_info["rank_ip"],
                                         int(bootstrap_info["rank_port"])))

    def _register_kv_args(self):
        pass

    def _check_waiting_timeout(self):
        if self.init_time is None:
            return None
        elapsed = time.time() - self.init_time
        if elapsed < self.kv_mgr.waiting_timeout:
            return None
        self.kv_mgr.record_failure(self.bootstrap_room, "Request %s timed out after %.1fs in "
                                   "KVPoll.WaitingForInput" % (self.bootstrap_room, elapsed))
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        if not self.abort_notified and getattr(self, "bootstrap_infos", None) is not None:
            self._send_abort_notification()
            self.abort_notified = True
        return KVPoll.Failed

    failure_exception = _fake_failure_exception

    def clear(self):
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.required_prefill_response_num_table.pop(self.bootstrap_room, None)
        self.kv_mgr.prefill_response_tracker.pop(self.bootstrap_room, None)

    def abort(self):
        _aborted(self)
        if not self.abort_notified and getattr(self, "bootstrap_infos", None) is not None:
            self._send_abort_notification()
            self.abort_notified = True

    def _send_abort_notification(self):
        for info in self.bootstrap_infos:
            try:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart([b"ABORT", str(self.bootstrap_room).encode("ascii"),
                                         self.kv_mgr.local_ip.encode("ascii"),
                                         str(self.kv_mgr.rank_port).encode("ascii")])
            except _wire_errors() as e:
                logger.debug("abort notification for room %s failed: %s",
                             self.bootstrap_room, e)


class CommonKVBootstrapServer:
    """The bootstrap server's routes (common/conn.py), on the standard
    library's threading HTTP server instead of aiohttp."""

    def __init__(self, host, port):
        self.host, self.port = host, port
        self.lock = threading.Lock()
        self.attn_tp_size = self.attn_cp_size = self.dp_size = self.pp_size = None
        self.page_size = self.kv_cache_dtype = None
        self.prefill_port_table = {}
        self._registered_count = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status, body):
                raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_PUT(self):
                if urllib.parse.urlsplit(self.path).path != "/route":
                    return self._reply(404, "Not found")
                try:
                    data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    server._put(data)
                except (ValueError, KeyError, TypeError) as e:
                    return self._reply(400, "bad registration: %s" % e)
                self._reply(200, "OK")

            def do_GET(self):
                parts = urllib.parse.urlsplit(self.path)
                if parts.path == "/health":
                    return self._reply(200, "OK")
                if parts.path != "/route":
                    return self._reply(404, "Not found")
                self._reply(*server._get(dict(urllib.parse.parse_qsl(parts.query))))

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                       name="sx-sglang-bootstrap")
        self.thread.start()

    def _is_ready(self):
        if None in (self.attn_tp_size, self.attn_cp_size, self.pp_size, self.dp_size):
            return False
        return self._registered_count >= \
            self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def _put(self, d):
        with self.lock:
            if self.attn_tp_size is None:
                self.attn_tp_size, self.attn_cp_size = d["attn_tp_size"], d["attn_cp_size"]
                self.dp_size = d["attn_dp_size"] if d["system_dp_size"] == 1 \
                    else d["system_dp_size"]
                self.pp_size = d["pp_size"]
                self.page_size, self.kv_cache_dtype = d["page_size"], d.get("kv_cache_dtype")
            dp_group = d["attn_dp_rank"] if d["system_dp_size"] == 1 else d["system_dp_rank"]
            table = self.prefill_port_table.setdefault(dp_group, {}).setdefault(
                d["attn_cp_rank"], {}).setdefault(d["attn_tp_rank"], {})
            table[d["pp_rank"]] = {"rank_ip": str(d["rank_ip"]),
                                   "rank_port": int(d["rank_port"])}
            self._registered_count += 1

    def _get(self, q):
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(k) for k in keys):
            return 400, "Missing inputs for bootstrap server."
        try:
            ranks = [int(q[k]) for k in keys]
        except ValueError:
            return 400, "ranks must be integers"
        with self.lock:
            if not self._is_ready():
                return 503, "Prefill server not fully registered yet (%d workers " \
                    "registered)." % self._registered_count
            if ranks == [-1, -1, -1, -1]:
                return 200, dataclasses.asdict(PrefillServerInfo(
                    attn_tp_size=self.attn_tp_size, attn_cp_size=self.attn_cp_size,
                    dp_size=self.dp_size, pp_size=self.pp_size, page_size=self.page_size,
                    kv_cache_dtype=self.kv_cache_dtype))
            try:
                dp, cp, tp, pp = ranks
                return 200, self.prefill_port_table[dp][cp][tp][pp]
            except KeyError:
                return 404, "Bootstrap info not found for dp_rank=%d cp_rank=%d tp_rank=%d " \
                    "pp_rank=%d" % tuple(ranks)

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()
        self.thread.join(timeout=2)
