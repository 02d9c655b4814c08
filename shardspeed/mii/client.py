"""``shardspeed.mii.serve``: start ``shardspeed-serve`` in a child process and talk to it (MII's client).

The client speaks to the server over HTTP with the standard library only, so a script that just sends
requests needs no web stack of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

__all__ = ["MIIClient", "client", "serve"]


class MIIClient:
    """MII's client: ``generate(prompts, max_new_tokens=…)`` and ``terminate_server()``."""

    def __init__(self, deployment_name: str, host: str = "127.0.0.1", port: int = 28080, process=None):
        self.deployment_name, self.base, self._process = deployment_name, f"http://{host}:{port}", process

    def _post(self, path: str, body: dict):
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def generate(self, prompts, max_new_tokens: int | None = None, **kwargs) -> list[dict]:
        """MII's generate: ``max_new_tokens`` (default 128) or ``max_length`` (prompt + new), sampling fields."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        body = {"prompts": prompts, **kwargs}
        if max_new_tokens is not None or "max_length" not in kwargs:
            body["max_new_tokens"] = 128 if max_new_tokens is None else max_new_tokens
        return self._post(f"/mii/{self.deployment_name}", body)

    def terminate_server(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _wait_ready(base: str, process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"shardspeed-serve exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    process.terminate()
    raise TimeoutError(f"shardspeed-serve did not answer on {base} within {timeout:.0f} s")


def serve(model_name_or_path: str, deployment_name: str | None = None, tensor_parallel: int = 1,
          restful_api_port: int = 28080, host: str = "127.0.0.1", max_batch: int = 32,
          timeout: float = 300.0, **kwargs) -> MIIClient:  # fmt: skip
    """MII's ``mii.serve``: start the HTTP server on ``restful_api_port`` and return a client for it."""
    name = deployment_name or os.path.basename(os.path.normpath(model_name_or_path))
    command = [sys.executable, "-m", "shardspeed.mii.server", str(model_name_or_path), "--host", host,
               "--port", str(restful_api_port), "--deployment-name", name,
               "--tensor-parallel", str(tensor_parallel), "--max-batch", str(max_batch)]  # fmt: skip
    process = subprocess.Popen(command)
    _wait_ready(f"http://{host}:{restful_api_port}", process, timeout)
    return MIIClient(name, host, restful_api_port, process)


def client(deployment_name: str, host: str = "127.0.0.1", port: int = 28080) -> MIIClient:
    """MII's ``mii.client``: a client for a server started elsewhere."""
    return MIIClient(deployment_name, host, port)
