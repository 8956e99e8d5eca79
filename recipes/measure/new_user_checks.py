"""The new user's trial on the default pair, the commands that are not timings: each run as a user would type it,
from an environment without LD_PRELOAD, with what it printed and whether the behaviour holds.

    python recipes/measure/new_user_checks.py

Checks: an offline unknown hub id fails fast in one line; `--model smollm2` and `dflash-convert --list` lead to the
default pair; seeded sampling keeps its prefix whatever --max-tokens; dflash-serve answers a chat request and,
stopped by SIGTERM mid-request, leaves the client a complete response or a well-formed error.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
CLEAN = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def run(*argv: str, env: dict | None = None, timeout: float = 600) -> tuple[int, str, float]:
    tic = time.perf_counter()
    p = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, env=env or CLEAN,
                       timeout=timeout)  # fmt: skip
    return p.returncode, (p.stdout + p.stderr).strip(), time.perf_counter() - tic


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def offline_unknown_repo() -> bool:
    ok = True
    # No network at all (the machine's state), then the hub client told to stay offline.
    for name, env in (("no network", {k: v for k, v in CLEAN.items() if k != "HF_HUB_OFFLINE"}),
                      ("HF_HUB_OFFLINE=1", {**CLEAN, "HF_HUB_OFFLINE": "1"})):  # fmt: skip
        rc, out, secs = run("dflash-generate", "--model", "someorg/no-such-repo", "--prompt", "hi", env=env)
        lines = [line for line in out.splitlines() if line.strip()]
        ok &= report(f"unknown hub id, {name}", rc != 0 and len(lines) <= 2 and secs < 20,
                     f"rc {rc}, {len(lines)} line(s) in {secs:.1f} s: {lines[-1] if lines else ''!r}")  # fmt: skip
    return ok


def default_pair_found() -> bool:
    rc, out, _ = run("dflash-generate", "--model", "smollm2", "--prompt", "Say hi", "--max-tokens", "8")
    by_name = report("--model smollm2", rc == 0, f"rc {rc}, last line {out.splitlines()[-1] if out else ''!r}")
    rc, out, _ = run("dflash-convert", "--list")
    listed = report("dflash-convert --list shows the default pair", rc == 0 and "SmolLM2" in out,
                    next((line.strip() for line in out.splitlines() if "SmolLM2" in line), "not listed"))  # fmt: skip
    return by_name and listed


def seeded_prefix() -> bool:
    texts = []
    for n in (14, 40):
        rc, out, _ = run("dflash-generate", "--prompt", "Explain what a hash table is", "--temp", "0.7", "--seed", "1",
                         "--max-tokens", str(n), "--verbose", "false")  # fmt: skip
        texts.append(out)
    short, long = texts
    return report(
        "seeded sampling keeps its prefix", long.startswith(short.rstrip()), f"{short[:60]!r} / {long[:60]!r}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(port: int, max_tokens: int) -> tuple[int, dict | None, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"messages": [{"role": "user", "content": "Explain what a hash table is"}], "max_tokens": max_tokens}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
    except (http.client.HTTPException, OSError) as e:
        return 0, None, f"{type(e).__name__}: {e}"
    try:
        return resp.status, json.loads(raw), raw[:80]
    except ValueError:
        return resp.status, None, raw[:80]


def serve_and_sigterm(tries: int = 3) -> bool:
    ok = True
    for i in range(tries):
        port = _free_port()
        server = subprocess.Popen([str(BIN / "dflash-serve"), "--port", str(port)], env=CLEAN,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        if i == 0:
            status, reply, _ = _chat(port, 12)
            content = (reply or {}).get("choices", [{}])[0].get("message", {}).get("content", "")
            ok &= report("dflash-serve answers", status == 200 and bool(content), f"{status}: {content[:50]!r}")
        result = {}
        client = threading.Thread(target=lambda: result.update(r=_chat(port, 200)))
        client.start()
        time.sleep(3.0 + i)  # mid-reply
        server.send_signal(signal.SIGTERM)
        client.join(120)
        server.wait(60)
        status, reply, raw = result.get("r", (0, None, "no answer"))
        whole = reply is not None and (status == 200 and "choices" in reply or status >= 400 and "error" in reply)
        ok &= report(f"SIGTERM mid-request, try {i + 1}", whole, f"HTTP {status}, {raw!r}")
    return ok


def main() -> None:
    results = [offline_unknown_repo(), default_pair_found(), seeded_prefix(), serve_and_sigterm()]
    print(f"{sum(results)} of {len(results)} checks hold")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
