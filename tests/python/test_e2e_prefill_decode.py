"""Prefill in one OS process, decode in another, the KV cache crossing
between them through segxfer (e2e_model.py has the model and the roles):
the tokens, and the logits bit for bit on CPU, equal a single-process run.
A layout mismatch (another dtype, another head count) is refused before a
byte is read, and a prefill process that dies first gives a clear error,
not tokens.

The device and transport are parameters, so the GPU runs are one line:

  SEGXFER_E2E_DEVICE=cuda:0 SEGXFER_E2E_TRANSPORT=cuda_ipc \\
  SEGXFER_E2E_RESULTS=tests/gpu/results python3 -m pytest -q tests/python/test_e2e_prefill_decode.py

(or without pytest: python3 tests/python/test_e2e_prefill_decode.py).  The
logits must be equal bit for bit on CUDA too: both processes run the same
kernels on the same inputs, and cuBLAS promises bitwise reproducible results
for a toolkit version on GPUs of the same architecture and SM count (it held
on an H100: tests/gpu/results/).
"""
import json
import os
import signal
import subprocess
import sys
import time

import torch

try:
    import pytest
    parametrize = pytest.mark.parametrize
except ImportError:        # run as a script where pytest is absent (below)
    def parametrize(names, cases):
        return lambda fn: fn

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "e2e_model.py")
DEVICE = os.environ.get("SEGXFER_E2E_DEVICE", "cpu")
TRANSPORT = os.environ.get("SEGXFER_E2E_TRANSPORT", "tcp")
RESULTS = os.environ.get("SEGXFER_E2E_RESULTS")
STEPS = 12


def role(*args, stdin=None):
    """One of e2e_model.py's roles in a process of its own."""
    return subprocess.Popen([sys.executable, MODEL, *args, "--device", DEVICE,
                             "--transport", TRANSPORT], stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return proc.returncode, lines, err


class Prefill:
    """The prefill process: started, published, waiting to be told done."""

    def __init__(self, url, tmp, name="e2e/prefill-0", extra=()):
        self.out = str(tmp / ("prefill-%s.pt" % name.replace("/", "_")))
        self.proc = role("prefill", "--url", url, "--name", name, "--out", self.out, *extra,
                         stdin=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("prefill failed: " + self.proc.stderr.read())
        self.info = json.loads(line)

    def done(self):
        rc, lines, err = finish_stdin(self.proc)
        assert rc == 0, err
        return lines[-1]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.proc.stdin.close()


def finish_stdin(proc):
    out, err = proc.communicate("done\n", timeout=60)
    return proc.returncode, [json.loads(x) for x in out.splitlines() if x.startswith("{")], err


def start_decode(url, tmp, info, *extra, stdin=None):
    out = str(tmp / "decode.pt")
    proc = role("decode", "--url", url, "--peer", info["segment"], "--out", out,
                "--remote-blocks", ",".join(map(str, info["block_ids"])),
                "--prompt-len", str(info["prompt_len"]),
                "--first-token", str(info["first_token"]), "--steps", str(STEPS), *extra,
                stdin=stdin)
    return proc, out


def decode(url, tmp, info, *extra):
    proc, out = start_decode(url, tmp, info, *extra)
    rc, lines, err = finish(proc)
    return rc, (lines[-1] if lines else {}), err, out


def decode_after(action, url, tmp, info, *extra):
    """A decode process that is set up (torch loaded, cache registered)
    before action() runs, and opens the peer right after it."""
    proc, out = start_decode(url, tmp, info, "--go-on-stdin", *extra, stdin=subprocess.PIPE)
    ready = proc.stdout.readline()
    assert ready.startswith("{"), proc.stderr.read()
    action()
    out_text, err = proc.communicate("go\n", timeout=120)
    lines = [json.loads(x) for x in out_text.splitlines() if x.startswith("{")]
    return proc.returncode, (lines[-1] if lines else {}), err, out


def reference(tmp, *extra):
    out = str(tmp / "reference.pt")
    rc, _, err = finish(role("reference", "--steps", str(STEPS), "--out", out, *extra))
    assert rc == 0, err
    return torch.load(out)


def same(a, b):
    return torch.equal(a, b)            # bit for bit, CPU and CUDA alike


def record(name, data):
    if RESULTS:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, "e2e-%s-%s-%s.json" % (name, DEVICE.replace(":", ""),
                                                           TRANSPORT))
        with open(path, "w") as f:
            json.dump(dict(data, device=DEVICE, transport=TRANSPORT,
                           torch=torch.__version__, python=sys.version.split()[0]), f,
                      indent=1)


def test_e2e_tokens_and_logits_equal_a_single_process_run(url, tmp_path):
    ref = reference(tmp_path)
    prefill = Prefill(url, tmp_path)
    try:
        rc, res, err, out = decode(url, tmp_path, prefill.info)
        assert rc == 0, (res, err)
    finally:
        served = prefill.done()
    got = torch.load(out)
    prefill_logits = torch.load(prefill.out)
    info = prefill.info
    # The decode side used other block ids than the prefill side.
    assert len(res["local_blocks"]) == len(info["block_ids"]) == 4
    assert all(l != r for l, r in zip(res["local_blocks"], info["block_ids"]))
    assert res["transport"] == TRANSPORT or TRANSPORT == "auto"
    assert served["served_reads"] > 0 or TRANSPORT != "tcp"
    assert same(prefill_logits, ref["prefill_logits"])
    assert info["first_token"] == ref["tokens"][0]
    assert got["tokens"] == ref["tokens"][1:]
    assert same(got["logits"], ref["decode_logits"])
    record("equal", {"tokens": ref["tokens"], "decode_tokens": got["tokens"],
                     "prefill_blocks": info["block_ids"], "decode_blocks": res["local_blocks"],
                     "max_abs_logit_diff": float((got["logits"] -
                                                  ref["decode_logits"]).abs().max()),
                     "bitwise": torch.equal(got["logits"], ref["decode_logits"]),
                     "prefill_max_abs_logit_diff": float((prefill_logits -
                                                          ref["prefill_logits"]).abs().max()),
                     "prefill_bitwise": torch.equal(prefill_logits, ref["prefill_logits"])})
    print("logits: decode bitwise %s (max |diff| %g), prefill bitwise %s"
          % (torch.equal(got["logits"], ref["decode_logits"]),
             float((got["logits"] - ref["decode_logits"]).abs().max()),
             torch.equal(prefill_logits, ref["prefill_logits"])))


def test_e2e_the_pulled_cache_is_what_decides_the_output(url, tmp_path):
    """Without the pull the same decode gives other logits: the equality
    above is the transferred cache's doing, not the model's."""
    ref = reference(tmp_path)
    prefill = Prefill(url, tmp_path)
    try:
        rc, res, err, out = decode(url, tmp_path, prefill.info, "--skip-pull")
        assert rc == 0, (res, err)
    finally:
        prefill.done()
    got = torch.load(out)
    assert not torch.equal(got["logits"], ref["decode_logits"])


MISMATCHES = [
    (("--dtype", "fp16"), "dtype", "fp16", "fp32"),
    (("--kv-heads", "1"), "block_bytes", str(4 * 1 * 16 * 4), str(4 * 2 * 16 * 4)),
]


@parametrize("extra, kind, local, remote", MISMATCHES)
def test_e2e_layout_mismatch_is_refused_before_reading(url, tmp_path, extra, kind, local,
                                                        remote):
    prefill = Prefill(url, tmp_path)
    try:
        rc, res, err, out = decode(url, tmp_path, prefill.info, *extra)
    finally:
        served = prefill.done()
    assert rc == 3, err
    assert res["error"] == "IncompatibleLayout"
    assert (res["kind"], res["local"], res["remote"]) == (kind, local, remote)
    assert served["served_reads"] == 0
    assert not os.path.exists(out)


def test_e2e_dead_prefill_gives_an_error_not_tokens(url, tmp_path):
    lease = 3.0
    prefill = Prefill(url, tmp_path, extra=("--lease-ms", str(int(lease * 1000))))
    info = prefill.info
    killed = []
    # Within the lease the descriptor is still there: the read fails.
    rc, res, err, out = decode_after(lambda: (prefill.kill(), killed.append(time.monotonic())),
                                     url, tmp_path, info)
    assert rc == 3, err
    assert res["error"] in ("SX_EUNREACH", "SX_EDISCONN", "SX_EIO"), res
    assert res["message"]
    assert not os.path.exists(out)
    # After the lease the segment is gone from the store.
    time.sleep(max(0.0, killed[0] + lease + 0.5 - time.monotonic()))
    rc, res, err, out = decode(url, tmp_path, info, "--open-timeout", "0.3")
    assert rc == 3, err
    assert res["error"] == "SX_ENOENT" and info["segment"] in res["message"]
    assert not os.path.exists(out)


# Layouts that differ but fit (read plans): (name, prefill ranks, prefill
# arguments, decode arguments, arguments of every role).
PLANS = [
    ("tp2_to_tp1", 2, (), (), ()),
    ("tp1_to_tp2", 1, (), ("--tp-size", "2"), ()),
    ("gqa_tp4_to_tp1", 4, (), (), ()),
    ("block32_to_block16", 1, ("--block-size", "32"), ("--block-size", "16"),
     ("--prompt-len", "40")),
    ("nhd_to_hnd", 1, ("--kv-layout", "NHD"), ("--kv-layout", "HND"), ()),
]


@parametrize("name, ranks, pre, dec, both", PLANS)
def test_e2e_plan_tokens_and_logits_equal_a_single_process_run(url, tmp_path, name, ranks,
                                                                pre, dec, both):
    """The prefill ranks each hold their share of the KV heads (--tp-size);
    the decode side reads them as one set through a read plan and decodes:
    tokens and logits equal the single-process run bit for bit."""
    ref = reference(tmp_path, *both)
    engine = "e2e/plan-%s" % name
    prefills = []
    try:
        for r in range(ranks):
            prefills.append(Prefill(url, tmp_path, name="%s/tp%d" % (engine, r),
                                    extra=("--plan", "--tp-rank", str(r), "--tp-size",
                                           str(ranks), *pre, *both)))
        info = prefills[0].info
        assert all(p.info["block_ids"] == info["block_ids"] for p in prefills)
        out = str(tmp_path / "decode.pt")
        proc = role("decode", "--url", url, "--peer", engine, "--peer-tp", str(ranks),
                    "--plan", "--out", out,
                    "--remote-blocks", ",".join(map(str, info["block_ids"])),
                    "--prompt-len", str(info["prompt_len"]),
                    "--first-token", str(info["first_token"]), "--steps", str(STEPS),
                    *dec, *both)
        rc, lines, err = finish(proc)
        res = lines[-1] if lines else {}
        assert rc == 0, (res, err)
    finally:
        served = [p.done() for p in prefills]
    got = torch.load(out)
    assert info["first_token"] == ref["tokens"][0]
    assert same(torch.load(prefills[0].out), ref["prefill_logits"])
    assert got["tokens"] == ref["tokens"][1:]
    assert same(got["logits"], ref["decode_logits"])
    # Every rank that holds heads nobody else holds was read from; with
    # replicas (GQA) the reader picks one of each pair.
    if TRANSPORT == "tcp":
        readers = sum(1 for s in served if s["served_reads"] > 0)
        assert readers == (2 if ranks == 4 else ranks), served
    assert all("reads" in p for p in res["plans"]), res["plans"]
    record("plan-" + name, {"tokens": ref["tokens"], "decode_tokens": got["tokens"],
                            "plans": res["plans"],
                            "bitwise": torch.equal(got["logits"], ref["decode_logits"])})


def test_e2e_plan_refuses_a_set_with_a_rank_missing(url, tmp_path):
    """Only rank 0 of a TP=2 prefill is up: the decode side is refused with
    the head nobody holds, before any byte is read."""
    engine = "e2e/plan-missing"
    prefill = Prefill(url, tmp_path, name="%s/tp0" % engine,
                      extra=("--plan", "--tp-rank", "0", "--tp-size", "2"))
    try:
        out = str(tmp_path / "decode.pt")
        proc = role("decode", "--url", url, "--peer", "%s/tp0" % engine, "--plan",
                    "--out", out, "--remote-blocks",
                    ",".join(map(str, prefill.info["block_ids"])),
                    "--prompt-len", str(prefill.info["prompt_len"]),
                    "--first-token", str(prefill.info["first_token"]))
        rc, lines, err = finish(proc)
    finally:
        served = prefill.done()
    assert rc == 3, err
    res = lines[-1]
    assert res["error"] == "IncompatibleLayout"
    assert (res["kind"], res["local"]) == ("heads_missing", "1")
    assert served["served_reads"] == 0
    assert not os.path.exists(out)


if __name__ == "__main__":
    # Without pytest (the GPU machine may lack it): a redis-server of our own,
    # then every scenario once.
    import pathlib
    import tempfile
    sys.path.insert(0, HERE)
    from harness import RedisServer
    with tempfile.TemporaryDirectory() as d:
        r = RedisServer(pathlib.Path(d))
        try:
            base = "redis://127.0.0.1:%d?namespace=e2e-" % r.port
            cases = [("equal", test_e2e_tokens_and_logits_equal_a_single_process_run, ()),
                     ("pulled", test_e2e_the_pulled_cache_is_what_decides_the_output, ())]
            for n, case in enumerate(MISMATCHES):
                cases.append(("mismatch%d" % n,
                              test_e2e_layout_mismatch_is_refused_before_reading, case))
            cases.append(("dead", test_e2e_dead_prefill_gives_an_error_not_tokens, ()))
            for case in PLANS:
                cases.append(("plan-" + case[0],
                              test_e2e_plan_tokens_and_logits_equal_a_single_process_run,
                              case))
            cases.append(("plan-missing", test_e2e_plan_refuses_a_set_with_a_rank_missing, ()))
            for name, fn, args in cases:
                tmp = pathlib.Path(tempfile.mkdtemp(dir=d))
                fn(base + name, tmp, *args)
                print("PASS", fn.__name__, *args[:1])
        finally:
            r.stop()
