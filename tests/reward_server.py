"""A real HTTP reward service for tests/test_reward_services.py (standard library only, so it starts fast).

``python3 tests/reward_server.py [--port P] [--delay S] [--fail-first N] [--exit-after N] [--api-key K]
[--log FILE]`` serves on 127.0.0.1 (port 0: any free one) and prints ``port <P>`` on stdout once listening:

- ``POST /score`` (rlflow's JSON scoring protocol): sample i scores 1.0 when ``responses[i]`` with spaces
  stripped equals ``answers[i]``, else ``len(responses[i]) / 10`` (without ``answers``: the latter);
  ``POST /short``: the same scores but the last (a reply of the wrong length); ``POST /unsized``: /score's
  reply without a Content-Length (its end is the connection's close);
- ``POST /trickle``: HTTP 200 with ``Content-Length: 100000``, then one byte every 0.5 s until the client
  hangs up; ``POST /redirect``: HTTP 302 to this server's ``/score``;
- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the OpenAI shape): the reply to a text that is a
  number is ``"Score: <text>"``, to any other text ``"no idea"``;
- ``--delay S``: every reply waits S seconds first; ``--fail-first N``: the first N requests get HTTP 503;
  ``--exit-after N``: the process exits (``os._exit``, as if killed) right after replying to request N;
  ``--api-key K``: a request without ``Authorization: Bearer K`` gets HTTP 401;
- ``--log FILE``: one JSON line per request, ``{"path", "samples", "in_flight"}`` (requests being handled,
  this one included) and the body's ``model``, ``max_tokens``, ``temperature`` where it has them.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _judge(text: str) -> str:
    try:
        float(text)
    except ValueError:
        return "no idea"
    return f"Score: {text}"


def make_server(
    port: int = 0,
    delay: float = 0.0,
    fail_first: int = 0,
    exit_after: int = 0,
    api_key: str | None = None,
    log: str | None = None,
) -> ThreadingHTTPServer:
    """The server (not yet serving), bound to 127.0.0.1:``port``; the options as the command line's."""
    lock = threading.Lock()
    count, in_flight = [0], [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, data: Any, sized: bool = True) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            if sized:
                self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            self.wfile.flush()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                count[0] += 1
                in_flight[0] += 1
                n = count[0]
                samples = len(body.get("responses") or body.get("prompt") or body.get("messages") or [])
                line = {"path": self.path, "samples": samples, "in_flight": in_flight[0]}
                line |= {k: body[k] for k in ("model", "max_tokens", "temperature") if k in body}
                if log:
                    with open(log, "a") as f:
                        f.write(json.dumps(line) + "\n")
            time.sleep(delay)
            with lock:
                in_flight[0] -= 1
            if api_key is not None and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "bad api key"})
            elif n <= fail_first:
                self._send(503, {"error": "warming up"})
            elif self.path in ("/score", "/short", "/unsized"):
                answers = body.get("answers")
                scores = [
                    1.0 if answers is not None and r.replace(" ", "") == answers[i] else len(r) / 10
                    for i, r in enumerate(body["responses"])
                ]
                reply = scores[:-1] if self.path == "/short" else scores
                self._send(200, {"scores": reply}, sized=self.path != "/unsized")
            elif self.path == "/trickle":
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                try:
                    for _ in range(100000):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:  # the client hung up
                    pass
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/score")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/chat/completions":
                text = body["messages"][-1]["content"]
                message = {"role": "assistant", "content": _judge(text)}
                self._send(200, {"choices": [{"index": 0, "message": message}]})
            elif self.path == "/v1/completions":
                # choices in reverse order: a client must match them by index
                choices = [{"index": i, "text": _judge(t)} for i, t in enumerate(body["prompt"])]
                self._send(200, {"choices": choices[::-1]})
            else:
                self._send(404, {"error": f"no {self.path}"})
            if exit_after and n >= exit_after:
                os._exit(0)

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve_in_thread(**options: Any) -> str:
    """A server with ``options`` serving from a daemon thread of this process; its base URL
    ``http://127.0.0.1:<port>`` (no ``exit_after``: it would end this process)."""
    assert not options.get("exit_after")
    server = make_server(**options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--log", default=None)
    o = p.parse_args()
    server = make_server(o.port, o.delay, o.fail_first, o.exit_after, o.api_key, o.log)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
