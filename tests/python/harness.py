"""What the Python tests share that does not need pytest: the paths (the
package and library of this tree), a redis-server of their own on a free
loopback port, sx-agent processes, the fixtures' layout and sx-agent's fill
pattern.  conftest.py builds the pytest fixtures on it; the end-to-end test
and the benchmark use it directly, so they also run where pytest is absent.

SEGXFER_BUILD names the build tree (default build/); SEGXFER_LIB overrides
the library itself.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SEGXFER_BUILD", os.path.join(ROOT, "build")))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("SEGXFER_LIB", os.path.join(BUILD, "lib", "libsegxfer.so"))


class Missing(RuntimeError):
    """Something the tests need is not installed or built (they skip)."""


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
            raise Missing("redis-server is not installed (make deps installs it)")
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


class RedisCluster:
    """A Redis Cluster of 3 masters and 3 replicas on free loopback ports
    (redis-server --cluster-enabled yes, joined by redis-cli --cluster
    create --cluster-replicas 1), keyspace notifications on every node."""

    def __init__(self, workdir):
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise Missing("redis-server/redis-cli are not installed (make deps)")
        self.procs, self.ports = [], []
        for _ in range(200):
            if len(self.ports) == 6:
                break
            # A node also listens on port + 10000 (the cluster bus).
            port = free_port()
            if port > 55535:
                continue
            d = workdir / str(port)
            d.mkdir()
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--notify-keyspace-events", "Kx",
                 "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                 "--cluster-config-file", "nodes.conf", "--repl-diskless-sync-delay", "0",
                 "--dir", str(d), "--logfile", str(d / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(50):
                if _redis_pid(port) == proc.pid:
                    self.procs.append(proc)
                    self.ports.append(port)
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            else:
                proc.kill()
                proc.wait()
        if len(self.ports) < 6:
            self.stop()
            raise RuntimeError("could not start six redis-server cluster nodes")
        out = subprocess.run(
            [cli, "--cluster", "create", *["127.0.0.1:%d" % p for p in self.ports],
             "--cluster-replicas", "1", "--cluster-yes"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError("redis-cli --cluster create failed:\n" + out.stdout.decode())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [subprocess.run([cli, "-p", str(p), "cluster", "info"],
                                    stdout=subprocess.PIPE).stdout for p in self.ports]
            if all(b"cluster_state:ok" in i for i in infos):
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the cluster did not become ok")

    def url(self, ns):
        return "redis+cluster://%s?namespace=%s" % (
            ",".join("127.0.0.1:%d" % p for p in self.ports), ns)

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


LAYERS, BLOCK_BYTES, TARGET_BLOCKS, READER_BLOCKS = 3, 4096, 32, 16
LAYOUT = dict(fingerprint="pytest-llama/v1", tag="NHD", dtype="bf16")


def sx_agent_bin():
    path = os.path.join(BUILD, "bin", "sx-agent")
    if not os.access(path, os.X_OK):
        raise Missing("%s is not built (make)" % path)
    return path


class SxAgentProc:
    """build/bin/sx-agent holding a pool of the fixtures' layout."""

    def __init__(self, url, name, blocks=TARGET_BLOCKS, block_bytes=BLOCK_BYTES,
                 layers=LAYERS, fill=42, extra=()):
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


def fill_pattern(seed, region, offset, length):
    """The bytes `sx-agent --fill SEED` puts at offset..+length of region
    (its help text and agent/pattern.c: byte o is byte o % 8, little-endian,
    of splitmix64((SEED ^ region * 0xD1B54A32D192ED03) + (o / 8) *
    0x9E3779B97F4A7C15)), computed with numpy a word at a time."""
    import numpy as np
    u = np.uint64
    first, last = offset // 8, (offset + length + 7) // 8
    key = u((seed ^ (region * 0xD1B54A32D192ED03)) & (2**64 - 1))
    with np.errstate(over="ignore"):
        z = key + np.arange(first, last, dtype=u) * u(0x9E3779B97F4A7C15)
        z = (z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> u(27))) * u(0x94D049BB133111EB)
        z ^= z >> u(31)
    start = offset - first * 8
    return z.astype("<u8").tobytes()[start:start + length]

