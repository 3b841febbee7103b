"""Shared fixtures: the package from this tree, a real redis-server on a free
loopback port for the session, a namespace per test, and agent pairs.

Run with Debian's interpreter (the one python3-torch and python3-pytest
install into):  /usr/bin/python3 -m pytest tests/python
SEGXFER_BUILD names the build tree (default build/); SEGXFER_LIB overrides
the library itself.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SEGXFER_BUILD", os.path.join(ROOT, "build")))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("SEGXFER_LIB", os.path.join(BUILD, "lib", "libsegxfer.so"))

import segxfer  # noqa: E402  (after the path is set)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_pid(port):
    """The process_id a redis-server on port answers with, or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    m = re.search(rb"process_id:(\d+)", data)
    return int(m.group(1)) if m else None


class RedisServer:
    def __init__(self, workdir):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (make deps installs it)")
        for _ in range(20):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--notify-keyspace-events", "Kx",
                 "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(50):
                # Ours answers with our pid: a server that already held the
                # port (ours then failed to bind and exited) does not count.
                if _redis_pid(self.port) == self.proc.pid:
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
            self.stop()
        raise RuntimeError("could not start redis-server")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def redis(tmp_path_factory):
    r = RedisServer(tmp_path_factory.mktemp("redis"))
    yield r
    r.stop()


_seq = [0]


@pytest.fixture
def url(redis, request):
    """A metadata URL with a namespace of this test's own."""
    _seq[0] += 1
    ns = ("t%d-%s" % (_seq[0], re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)))[:60]
    return "redis://127.0.0.1:%d?namespace=%s" % (redis.port, ns)


LAYERS, BLOCK_BYTES, TARGET_BLOCKS, READER_BLOCKS = 3, 4096, 32, 16
LAYOUT = dict(fingerprint="pytest-llama/v1", tag="NHD", dtype="bf16")


def pattern(layers, blocks, seed):
    """A cache whose every block is recognisable: bytes of (seed, layer, block)."""
    out = bytearray(layers * blocks * BLOCK_BYTES)
    for layer in range(layers):
        for b in range(blocks):
            off = (layer * blocks + b) * BLOCK_BYTES
            stamp = bytes([seed & 0xFF, layer, b & 0xFF, b >> 8]) * (BLOCK_BYTES // 4)
            out[off:off + BLOCK_BYTES] = stamp
    return out


def block(buf, blocks, layer, b):
    off = (layer * blocks + b) * BLOCK_BYTES
    return bytes(buf[off:off + BLOCK_BYTES])


def register_kv(agent, blocks, seed=None):
    """K and V caches of LAYERS layers x blocks blocks (bytearrays)."""
    mem = []
    for slot in ("K", "V"):
        buf = pattern(LAYERS, blocks, seed + (slot == "V")) if seed is not None else \
            bytearray(LAYERS * blocks * BLOCK_BYTES)
        agent.register(buf, layers=LAYERS, slot=slot, block_bytes=BLOCK_BYTES)
        mem.append(buf)
    return mem


class Pair:
    """A published target (pattern-filled) and a reader with a smaller
    cache of the same layout, in this process."""

    def __init__(self, url, name="prefill-0", seed=7, **reader_kw):
        self.name, self.seed = name, seed
        self.target = segxfer.Agent(name, url, lease_ms=2000, log_level="warn", **LAYOUT)
        self.tmem = register_kv(self.target, TARGET_BLOCKS, seed)
        self.target.publish()
        kw = dict(LAYOUT, log_level="warn")
        kw.update(reader_kw)
        self.reader = segxfer.Agent(None, url, **kw)
        self.rmem = register_kv(self.reader, READER_BLOCKS)

    def expect(self, remote, local, slots=(0, 1), layers=range(LAYERS)):
        for s in slots:
            for layer in layers:
                for r, l in zip(remote, local):
                    assert block(self.rmem[s], READER_BLOCKS, layer, l) == \
                        block(self.tmem[s], TARGET_BLOCKS, layer, r), (s, layer, r, l)

    def close(self):
        self.reader.close()
        self.target.close()


@pytest.fixture
def pair(url):
    p = Pair(url)
    yield p
    p.close()


def sx_agent_bin():
    path = os.path.join(BUILD, "bin", "sx-agent")
    if not os.access(path, os.X_OK):
        pytest.skip("%s is not built (make)" % path)
    return path


class SxAgentProc:
    """build/bin/sx-agent holding a pool of the fixtures' layout."""

    def __init__(self, url, name, blocks=TARGET_BLOCKS, block_bytes=BLOCK_BYTES,
                 layers=LAYERS, fill=42, extra=()):
        import tempfile
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sx-agent-", suffix=".log")
        self.proc = subprocess.Popen(
            [sx_agent_bin(), "--name", name, "--metadata", url, "--listen", "127.0.0.1:0",
             "--layers", str(layers), "--block-bytes", str(block_bytes), "--num-blocks",
             str(blocks), "--fingerprint", LAYOUT["fingerprint"], "--dtype",
             LAYOUT["dtype"], "--tag", LAYOUT["tag"], "--fill", str(fill),
             "--lease-ms", "2000", *extra], stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.log.seek(0)
            if "ready:" in self.log.read():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.log.seek(0)
        out = self.log.read()
        self.stop()
        raise RuntimeError("sx-agent did not get ready:\n" + out)

    def pause(self):
        """SIGSTOP, and wait until every thread has stopped (the signal is
        delivered asynchronously): connections then hang, nothing answers."""
        os.kill(self.proc.pid, 19)
        task_dir = "/proc/%d/task" % self.proc.pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(task_dir):
                try:
                    with open("%s/%s/stat" % (task_dir, tid)) as f:
                        states.append(f.read().rpartition(")")[2].split()[0])
                except FileNotFoundError:
                    pass
            if states and all(st in "tT" for st in states):
                return
            time.sleep(0.005)
        raise RuntimeError("sx-agent did not stop")

    def resume(self):
        os.kill(self.proc.pid, 18)   # SIGCONT

    def stop(self):
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def sx_agent(url):
    procs = []

    def start(name, **kw):
        p = SxAgentProc(url, name, **kw)
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def reader(url):
    a = segxfer.Agent(None, url, log_level="error", **LAYOUT)
    a.mem = register_kv(a, READER_BLOCKS)
    yield a
    a.close()


@pytest.fixture
def stuck(reader, sx_agent):
    """(segment, its owner): an sx-agent that is stopped (SIGSTOP) after the
    reader opened it, so batches on it hang until their deadline or a
    cancel.  target.resume() lets them finish."""
    target = sx_agent("stuck-0")
    seg = reader.open("stuck-0")
    target.pause()
    yield seg, target
    seg.close()


def cancel_while_awaited(batch):
    """Await batch in a task and cancel the task: the batch is cancelled
    with it (pytest.raises checks the task ends CancelledError)."""
    import asyncio

    async def main():
        task = asyncio.ensure_future(batch._wait_async())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
