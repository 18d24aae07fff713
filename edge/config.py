"""The one TOML config file, typed and validated.

Every field error names the file and the dotted field (`models[0].n_ctx`) and says what was
expected and what was found. Nothing here imports native code, so `edge doctor` and the CLI
can load and check a config on any machine. Each table is built by `edge.toml.build_dataclass`
from the dataclasses below; `builtin:` names are checked against `edge.builtin_models`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge import toml as tomllib
from edge.builtin_models import BUILTINS  # light: the table, not the model
from edge.engineconfig import BatchingConfig, EngineConfig, check_engines, check_name
from edge.errors import ConfigError
from edge.fsutil import write_probe  # the probe check_writable makes (edge doctor's too)
from edge.prefixconfig import (POOLING, AdapterConfig, EmbeddingsConfig, MessageConfig, PrefixConfig, SpeculativeConfig,
                               check_adapters, check_prefixes)
from edge.toml import build_dataclass, value_range as _range  # also the engine recipes' builder (edge.engines.recipe)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes, one of them the terminating NUL
_HOST = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")

__all__ = ["AdapterConfig", "BUILTIN_PREFIX", "DEFAULT_LISTEN", "DEFAULT_MAX_CONNECTIONS", "LOG_LEVELS", "DEFAULT_URL",
           "SYSTEM_CONFIG", "load", "Config", "MessageConfig", "ModelConfig", "PrefixConfig", "PathsConfig",
           "ServerConfig", "SpeculativeConfig", "WarmupConfig", "BatchingConfig", "EmbeddingsConfig", "EngineConfig",
           "KV_TYPES", "QUANTIZED_KV_TYPES", "POOLING", "default_config", "find_config",
           "load_config", "read_config_text", "parse_config", "build_dataclass", "state_dir", "cache_dir",
           "check_writable", "write_probe"]

BUILTIN_PREFIX = "builtin:"
# Defaults written once: the CLI, the unit renderer and the [server] table take them from here.
SYSTEM_CONFIG = Path("/etc/edge/edge.toml")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8088
DEFAULT_LISTEN = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_URL = f"http://{DEFAULT_LISTEN}"
DEFAULT_MAX_CONNECTIONS = 1024
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST  # the address to listen on, used only when not socket-activated
    port: int = field(default=DEFAULT_PORT, metadata=_range(0, 65535))  # the TCP port, used only when not socket-activated
    unix_socket: str | None = None  # listen on this AF_UNIX path instead of host:port
    unix_socket_mode: str = "0660"  # the unix socket's file mode, in octal
    backlog: int = field(default=1024, metadata=_range(1, 65535))  # the listen backlog, when edge binds itself
    drain_timeout_s: float = field(default=30.0, metadata=_range(0, 3600))  # SIGTERM or a handover: in-flight requests get this long; then edge ends the rest (503, or a stream's error event and [DONE]) and exits within 2 s
    max_queue: int = field(default=64, metadata=_range(1, 100000))  # requests per model (tokenizing or generating) before 503 + Retry-After
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS})  # the log's threshold
    # What one client may hold or send (edge.serve.limits): beyond max_connections new connections
    # wait in the listen backlog; a request head must be complete within header_timeout_s of
    # the connection's opening (or of the end of its keep-alive idle time), a body within
    # body_timeout_s (else 408); a body over max_body_bytes is a 413.
    max_connections: int = field(default=DEFAULT_MAX_CONNECTIONS, metadata=_range(1, 1 << 20))
    header_timeout_s: float = field(default=10.0, metadata=_range(0.1, 3600))  # a request head (and, with TLS, the handshake before it) must be complete within this
    body_timeout_s: float = field(default=30.0, metadata=_range(0.1, 3600))  # a request body must be complete within this (else 408)
    keepalive_timeout_s: float = field(default=5.0, metadata=_range(0.1, 3600))  # idle keep-alive connections are closed after this
    max_body_bytes: int = field(default=8 << 20, metadata=_range(1024, 1 << 31))  # larger bodies: 413, before they are read
    reload: str = "auto"  # auto | overlap | sequential: how a reload makes room (docs/reload.md)
    # a stream's server-sent events: the first token at once, then at most one event per this
    # many ms carrying every token made meanwhile (0: an event per token)
    stream_interval_ms: float = field(default=40.0, metadata=_range(0.0, 1000.0))
    # the longest one request may hold its model (prefill and every token of every choice): past it
    # the generation ends at its next token with a 422 `generation_timeout` (docs/api.md, "Limits")
    request_timeout_s: float = field(default=600.0, metadata=_range(0.1, 86400.0))
    # safe mode (edge.lifecycle.safemode): a start that serves this long clears the crash count
    healthy_after_s: float = field(default=300.0, metadata=_range(1.0, 86400.0))
    # Who may ask (edge.serve.auth; docs/security.md): keys one per line
    # (# comments), not world-readable; the systemd credential edge-api-keys comes first.
    api_key_file: str | None = None
    metrics_auth: str = field(default="key", metadata={"choices": ("key", "open")})  # /metrics with API keys configured: keyed like the API (scrapers send a key), or "open" on purpose
    # a non-loopback socket without keys refuses to start (exit 78) unless this says it on purpose
    allow_unauthenticated: bool = False
    # TLS (edge.serve.tls): uvicorn's own, on the same sockets; or the credentials edge-tls-cert/-key
    tls_cert_file: str | None = None  # the certificate chain (PEM); needs tls_key_file; a restart, not a reload
    tls_key_file: str | None = None  # its private key (PEM), not world-readable
    # safe mode exhausted (edge.fleet.giveup): one start tries the native path again after this
    # long, then after twice as long, ... (at most 16 times): a backoff, never a loop
    give_up_retry_s: float = field(default=600.0, metadata=_range(1.0, 86400.0))


@dataclass(frozen=True)
class PathsConfig:
    state_dir: str | None = None  # reports, OTA versions; default: $STATE_DIRECTORY or /var/lib/edge
    cache_dir: str | None = None  # engines, assembled default model; default: $CACHE_DIRECTORY


# KV cache types llama.cpp accepts (llama-server's -ctk/-ctv); the quantized ones need flash
# attention for V, and a head size their block (32 elements) divides (edge.model.kvtypes).
KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
QUANTIZED_KV_TYPES = ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
@dataclass(frozen=True)
class ModelConfig:
    name: str  # the model's name in the API (/v2/models/{name}) and on /metrics
    path: str  # builtin:<name>, or a .gguf file (relative to the config file)
    kind: str = "gguf"  # the model file's format (GGUF only)
    sha256: str | None = None  # the file's sha256, verified once per file identity, during page-in
    # the context window, in tokens; None: the model's trained context, at most 32,768 and what 1/4
    # of the memory beside the weights holds (edge.model.memory.context_plan)
    n_ctx: int | None = field(default=None, metadata=_range(16, 1 << 20))
    n_batch: int = field(default=512, metadata=_range(1, 1 << 16))  # the logical batch of a prefill, in tokens
    n_threads: int = field(default=0, metadata=_range(0, 1024))  # 0: one per CPU core
    n_gpu_layers: int = field(default=0, metadata=_range(-1, 100000))  # layers offloaded to the GPU (-1: all); needs a CUDA build of llama.cpp
    use_mmap: bool = True  # llama.cpp maps the file instead of reading it
    use_mlock: bool = True  # lock the model's pages in RAM (no page-out under memory pressure)
    require_mlock: bool = False  # true: exit 77 if the lock does not take
    prefetch: bool = True  # read the file into the page cache in parallel before llama.cpp loads it
    prefetch_threads: int = field(default=4, metadata=_range(1, 64))  # threads of that page-in
    chat_template: str | None = None  # overrides the template stored in the GGUF
    max_tokens_default: int = field(default=256, metadata=_range(1, 1 << 20))  # max_tokens of a request that gives none
    max_choices: int = field(default=8, metadata=_range(1, 128))  # bound on n x prompts per request
    # sequences decoded at once in one llama.cpp context (continuous batching, edge.model.slots);
    # None: one per 512 tokens of n_ctx, at most 8 (edge.model.memory.context_plan)
    parallel: int | None = field(default=None, metadata=_range(1, 256))
    # llama.cpp context settings, with llama-server's defaults: flash attention decided by
    # llama.cpp for the device and model ("auto"), the physical batch (None: min(512, n_batch)),
    # batch threads (0: n_threads)
    flash_attn: bool | str = field(default="auto", metadata={"choices": ("auto", True, False)})
    # sliding-window layers (Gemma 3, ...): false keeps only their window, as llama-server does
    # (less KV memory, faster prefill); true keeps every position (any cached prefix reusable)
    swa_full: bool = False
    # llama.cpp's extra buffer types: weights repacked for the CPU's fastest kernels (a large
    # speed-up on ARM), and AMX where the build has it; false is llama.cpp's --no-repack. Safe mode
    # (edge.lifecycle.safemode) turns it off for a model whose load or warm-up crashed twice.
    use_extra_bufts: bool = True
    n_ubatch: int | None = field(default=None, metadata=_range(1, 1 << 16))  # the physical batch (None: min(512, n_batch))
    n_threads_batch: int = field(default=0, metadata=_range(0, 1024))  # prefill threads (0: n_threads)
    # The prompt cache (edge.model.promptcache): KV states of earlier prefixes in host memory, bounded
    # by bytes (None: two full contexts' KV, at most 1/16 of RAM; 0: off); declared prefixes,
    # restored from disk at every start; the N prefixes traffic reused most, saved at SIGTERM.
    prompt_cache_mb: int | None = field(default=None, metadata=_range(0, 1 << 20))
    prefixes: list[PrefixConfig] = field(default_factory=list)  # declared prefixes ([[models.prefixes]])
    learn_prefixes: int = field(default=0, metadata=_range(0, 64))  # N: the N prefixes traffic reused most, saved at SIGTERM
    # the KV cache's element types (llama-server's -ctk/-ctv): q8_0 holds about 1.9x the context of
    # f16 in the same memory; a quantized V needs flash attention (flash_attn "auto" turns it on)
    type_k: str = field(default="f16", metadata={"choices": KV_TYPES})
    type_v: str = field(default="f16", metadata={"choices": KV_TYPES})  # V's, as type_k is K's
    # /v1/embeddings from this model ([models.embeddings]; true: its defaults; edge.model.embed)
    embeddings: bool | EmbeddingsConfig | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # speculative decoding: [models.speculative]
    adapters: list[AdapterConfig] = field(default_factory=list)  # LoRA adapters ([[models.adapters]], edge.model.adapters)

    @property
    def flash_attn_mode(self) -> str:
        """"auto", "on" or "off" (llama.cpp's three)."""
        return "auto" if self.flash_attn == "auto" else "on" if self.flash_attn else "off"


@dataclass(frozen=True)
class WarmupConfig:
    enabled: bool = True  # false: only the floor request runs
    short_prompt: str = "Hello"  # the floor: this prompt, streamed, two tokens
    long_prefill_fraction: float = field(default=0.5, metadata=_range(0.0, 0.98))  # a long-prefill candidate of this fraction of n_ctx (of at most 4,096)
    decode_tokens: int = field(default=16, metadata=_range(1, 4096))  # the streamed-decode candidate's tokens
    chat: bool = True  # chat-template candidates
    prompts: list[str] = field(default_factory=list)  # extra prompts from the real workload
    # Calibration (edge.lifecycle.warmup.steps): a candidate is kept when its first run is slower than a repeat
    # of the same shape by more than max(min_gain_s, min_gain_ratio x repeat); calibration and
    # the stored plan each get budget_s seconds at most (what does not fit is reported).
    # The ratio sits above the repeat-to-repeat spread measured by scripts/bench warmup_noise on the
    # shared 2-core machine (|first - repeat| / repeat with nothing lazy: median 0.26, p95 0.39,
    # Gemma 270M, one thread); 20 ms is less than a step costs to run.
    budget_s: float = field(default=1.0, metadata=_range(0.0, 3600.0))
    min_gain_s: float = field(default=0.020, metadata=_range(0.0, 60.0))  # a candidate is kept when first - repeat > max(min_gain_s, min_gain_ratio x repeat)
    min_gain_ratio: float = field(default=0.5, metadata=_range(0.0, 100.0))  # see min_gain_s
    # When a model without a stored plan (or with candidates still pending) is calibrated:
    # before_ready (a start pays for it; first-use costs are real on a GPU, a request must not see
    # them), after_ready (the floor and the kept steps before READY, the rest measured in idle time
    # after it, giving way to every client request), auto (after_ready for GGUF models with
    # n_gpu_layers = 0 or a CPU build of llama.cpp, before_ready for offloaded models and engines).
    # `edge warmup` and a reload's new set always calibrate before they serve.
    calibrate: str = field(default="auto", metadata={"choices": ("auto", "before_ready", "after_ready")})
    after_ready_budget_s: float = field(default=30.0, metadata=_range(0.0, 3600.0))  # calibration after READY: its own budget (budget_s is the start's)
    after_ready_idle_s: float = field(default=0.5, metadata=_range(0.0, 3600.0))  # calibration after READY begins after this long with no client request


@dataclass(frozen=True)
class OtaConfig:
    """Defaults of `edge ota install` on this device; flags override them."""

    pubkey: str = "/etc/edge/ota.pub"  # the Ed25519 public key (PEM) bundles' signatures are checked with
    keep_versions: int = field(default=3, metadata=_range(2, 100))  # versions kept installed (current, previous and pending always stay)
    unit: str = "edge.service"  # the service unit activation restarts or reloads
    restart_cmd: str | None = None  # instead of `systemctl restart <unit>`
    health_url: str | None = None  # default: http://<server.host>:<server.port>/readyz
    timeout_s: float = field(default=300.0, metadata=_range(1, 86400))  # how long the new version may take to answer health_url
    # restart: `systemctl restart` (or restart_cmd); reload: zero-gap `edge reload` of the running
    # service (the new version warms beside the old; a failing one never takes traffic)
    activation: str = field(default="restart", metadata={"choices": ("restart", "reload")})


@dataclass(frozen=True)
class Config:
    models: list[ModelConfig] = field(default_factory=list)
    engines: list[EngineConfig] = field(default_factory=list)
    server: ServerConfig = field(default_factory=ServerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    ota: OtaConfig = field(default_factory=OtaConfig)
    source: str = "<defaults>"

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


MODEL_KINDS = ("gguf",)
RELOAD_MODES = ("auto", "overlap", "sequential")


def default_config() -> Config:
    """The embedded default: Gemma 3 270M Q4_K_M, assembled from its PyPI package on first use."""
    return Config(models=[ModelConfig(name="gemma3-270m", path=BUILTIN_PREFIX + "gemma3-270m")])


def find_config(explicit: str | None) -> Path | None:
    """--config, else $EDGE_CONFIG, else /etc/edge/edge.toml if present, else None (defaults)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("EDGE_CONFIG")
    if env:
        return Path(env)
    return SYSTEM_CONFIG if SYSTEM_CONFIG.is_file() else None


def load(explicit: str | Path | None) -> Config:
    """The config the lookup order finds (`find_config`), loaded and validated."""
    return load_config(find_config(str(explicit) if explicit else None))


def load_config(path: Path | None) -> Config:
    if path is None:
        return default_config()
    return parse_config(read_config_text(path), source=str(path), base_dir=path.parent)


def read_config_text(path: Path) -> str:
    """A config file's text; missing or unreadable is a ConfigError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "config file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot read config file: {exc}") from None


def parse_config(text: str, *, source: str = "<string>", base_dir: Path | None = None) -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    if "models" not in raw and "engines" not in raw:
        raise ConfigError(source, "models", "missing: expected at least one [[models]] or [[engines]] table")
    cfg = build_dataclass(Config, raw, source, "")
    cfg = dataclasses.replace(cfg, source=source)
    _check_models(cfg, source, base_dir)
    return cfg


def _check_models(cfg: Config, source: str, base_dir: Path | None) -> None:
    if not cfg.models and not cfg.engines:
        raise ConfigError(source, "models", "expected at least one [[models]] or [[engines]] table, found none")
    object.__setattr__(cfg, "engines", check_engines(cfg.engines, source, base_dir))
    seen: set[str] = {e.name for e in cfg.engines}
    resolved = []
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        check_name(m.name, source, f"{where}.name")
        if m.kind not in MODEL_KINDS:
            raise ConfigError(source, f"{where}.kind", f"expected one of {list(MODEL_KINDS)}, found {m.kind!r}")
        if m.name in seen:
            raise ConfigError(source, f"{where}.name", f"duplicate model name {m.name!r}")
        seen.add(m.name)
        if m.sha256 is not None and (len(m.sha256) != 64 or set(m.sha256.lower()) - set("0123456789abcdef")):
            raise ConfigError(source, f"{where}.sha256", f"expected 64 hex digits, found {m.sha256!r}")
        if m.path.startswith(BUILTIN_PREFIX):
            name = m.path[len(BUILTIN_PREFIX):]
            if name not in BUILTINS:
                raise ConfigError(source, f"{where}.path", f"unknown builtin model {name!r}; expected "
                                  f"one of {[BUILTIN_PREFIX + n for n in BUILTINS]} or a .gguf path")
        path = m.path
        if base_dir is not None and not path.startswith(BUILTIN_PREFIX) and not os.path.isabs(path):
            path = str((base_dir / path).resolve())  # relative paths are relative to the config file
        resolved.append(_check_cache(dataclasses.replace(m, path=path), source, where, base_dir))
    object.__setattr__(cfg, "models", resolved)
    _check_server(cfg.server, source)


def _check_server(server: ServerConfig, source: str) -> None:
    if not server.host.strip():
        raise ConfigError(source, "server.host", "expected an address such as \"127.0.0.1\", found an "
                          "empty string (which would listen on every interface)")
    if not _HOST.fullmatch(server.host):
        raise ConfigError(source, "server.host", f"expected an IP address or a host name, found {server.host!r}")
    if server.unix_socket and len(os.fsencode(server.unix_socket)) > UNIX_PATH_MAX:
        raise ConfigError(source, "server.unix_socket", f"expected a path of at most {UNIX_PATH_MAX} bytes (the "
                          f"AF_UNIX limit), found {len(os.fsencode(server.unix_socket))} bytes")
    if server.reload not in RELOAD_MODES:
        raise ConfigError(source, "server.reload", f"expected one of {list(RELOAD_MODES)}, found {server.reload!r}")
    mode = server.unix_socket_mode
    if not (mode.isdigit() and set(mode) <= set("01234567") and len(mode) <= 4):
        raise ConfigError(source, "server.unix_socket_mode", f"expected an octal mode such as \"0660\", found {mode!r}")


def _check_cache(m: ModelConfig, source: str, where: str, base_dir: Path | None) -> ModelConfig:
    """flash_attn, n_ubatch and the prompt cache's fields; declared prefixes checked and read."""
    if isinstance(m.flash_attn, str) and m.flash_attn != "auto":
        raise ConfigError(source, f"{where}.flash_attn", f"expected \"auto\", true or false, found {m.flash_attn!r}")
    if m.n_ubatch is not None and m.n_ubatch > m.n_batch:
        raise ConfigError(source, f"{where}.n_ubatch", f"expected at most n_batch ({m.n_batch}), found {m.n_ubatch}")
    if m.type_v in QUANTIZED_KV_TYPES and m.flash_attn is False:
        raise ConfigError(source, f"{where}.type_v", f"a quantized V cache ({m.type_v}) needs flash attention, "
                          "which flash_attn = false turns off: set flash_attn to \"auto\" or true, or type_v to f16")
    m = _check_embeddings(m, source, where)
    if (m.prefixes or m.learn_prefixes) and m.prompt_cache_mb == 0:
        what = "prefixes" if m.prefixes else "learn_prefixes"
        raise ConfigError(source, f"{where}.prompt_cache_mb", f"0 turns the prompt cache off, but {what} "
                          "needs it: remove prompt_cache_mb (sized automatically) or set it above 0")
    if m.speculative.ngram_min > m.speculative.ngram_max:
        raise ConfigError(source, f"{where}.speculative.ngram_min", f"expected at most ngram_max "
                          f"({m.speculative.ngram_max}), found {m.speculative.ngram_min}")
    return dataclasses.replace(m, prefixes=check_prefixes(m.prefixes, source, where, base_dir),
                               adapters=check_adapters(m.adapters, source, where, base_dir))


def _check_embeddings(m: ModelConfig, source: str, where: str) -> ModelConfig:
    """`embeddings = true` made the table of its defaults (false: none); its sizes checked."""
    e = EmbeddingsConfig() if m.embeddings is True else m.embeddings or None
    for i, d in enumerate(e.dimensions if e else ()):
        if d < 1:
            raise ConfigError(source, f"{where}.embeddings.dimensions[{i}]", f"expected a size of at least 1, found {d}")
    return dataclasses.replace(m, embeddings=e)


def state_dir(cfg: Config) -> Path:
    """Where start reports and OTA versions live: config, else systemd's StateDirectory=, else a default."""
    return _dir(cfg.paths.state_dir, "STATE_DIRECTORY", "/var/lib/edge", "state")


def cache_dir(cfg: Config) -> Path:
    """Where engines and the assembled default model live: config, else CacheDirectory=, else a default."""
    return _dir(cfg.paths.cache_dir, "CACHE_DIRECTORY", "/var/cache/edge", "cache")


def check_writable(cfg: Config) -> None:
    """Prove state_dir and cache_dir writable by a real write (a temp file created, fsynced and
    removed) before anything slow happens: a start report or an assembled model that cannot be
    written would otherwise fail the start at its end. ConfigError names the path (exit 78)."""
    for key, path in (("paths.state_dir", state_dir(cfg)), ("paths.cache_dir", cache_dir(cfg))):
        problem = write_probe(path)
        if problem:
            raise ConfigError(cfg.source, key, f"{path} is not writable ({problem}): set {key} to a "
                              "writable folder, or fix its permissions (under systemd: StateDirectory=/"
                              "CacheDirectory=)")


_XDG = {"state": ("XDG_STATE_HOME", ".local/state"), "cache": ("XDG_CACHE_HOME", ".cache")}


def _dir(configured: str | None, systemd_env: str, system: str, kind: str) -> Path:
    # $EDGE_HOME puts everything of one instance under one folder (tests, benchmarks, demos).
    if configured:
        return Path(configured)
    if os.environ.get(systemd_env):
        return Path(os.environ[systemd_env].split(":")[0])
    if os.environ.get("EDGE_HOME"):
        return Path(os.environ["EDGE_HOME"]) / kind
    if os.geteuid() == 0:
        return Path(system)
    xdg_env, home_rel = _XDG[kind]
    return Path(os.environ.get(xdg_env) or Path.home() / home_rel) / "edge"
