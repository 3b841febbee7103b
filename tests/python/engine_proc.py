"""An engine in a process of its own for the engine tests
(test_lmdeploy_engine.py, test_vllm_connector.py): started with
multiprocessing's 'spawn', as LMDeploy's engine, its Ray workers and
vLLM's workers are (a fresh interpreter that knows only its environment and
the parent's sys.path), and driven over a pipe by the test, which plays the
proxy."""
import multiprocessing
import traceback


def serve(conn, handlers, close):
    """The engine's side: answer (op, *args) requests with ("ok", result)
    or ("error", traceback) until "exit", which runs close()."""
    while True:
        op, *args = conn.recv()
        if op == "exit":
            close()
            conn.send(("ok", None))
            return
        try:
            handler = handlers.get(op)
            if handler is None:
                raise ValueError("unknown request %r" % (op,))
            out = handler(*args)
        except Exception:  # noqa: BLE001  (the test reports it)
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", out))


class EngineProcess:
    """The test's side: target(conn, *args) runs in a spawned process."""

    def __init__(self, target, *args):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,) + args)
        self.proc.start()
        child.close()

    def call(self, *req, timeout=60):
        self.conn.send(req)
        if not self.conn.poll(timeout):
            raise AssertionError("the engine did not answer %r in %ds" % (req[0], timeout))
        status, out = self.conn.recv()
        if status != "ok":
            raise AssertionError("the engine failed on %r:\n%s" % (req[0], out))
        return out

    def stop(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
