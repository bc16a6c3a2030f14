"""The serve stage: the artifacts the config names, loaded as the eval stage loads them (`engine=<kind>`,
pipeline.artifacts.load_engine), behind the OpenAI-compatible server of runner.serve until SIGTERM or SIGINT.

`+stage=serve` runs the stages up to export (from the store when cached), then this one in place of eval. It is
not content-addressed: it builds nothing, and its report (the requests served, by finish reason) goes into the
job's result.json and MLflow run when the server stops. The server's options are `serve.*`; a request's
defaults are runtime.chain, runtime.policy, runtime.temperature, runtime.seed and runtime.stop; the chat template
is the target artifact's. The API key comes from $EAGLE3_API_KEY only: the config is logged with the job. The
address is bound and the settings and chat template checked before the engine loads, so that a port in use, a
default temperature no request could have or a broken template stops the stage at once, naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from models.text import load_chat_template
from pipeline.artifacts import engine_upstream, load_engine

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
UPSTREAM = ("target", "draft", "export")
CONFIG_KEYS = ("runtime", "engine", "serve")
CONTENT_ADDRESSED = False


def upstream_for(cfg: DictConfig) -> tuple[str, ...]:
    return engine_upstream(cfg)


def run(cfg: DictConfig, upstream: dict, out: Path) -> dict:
    from tokenizers import Tokenizer

    from runner.requests import check_chat_template, encoder
    from runner.serve import API_KEY_ENV, Settings, check_settings, create_app, listen, run_server, warm_up

    rt, sc = cfg.runtime, cfg.serve
    target_dir = Path(upstream["target"].path)
    served = upstream.get("export") or upstream["draft"]  # the CUDA engine reads no export artifact
    given = {k: type(getattr(Settings, k))(sc[k])  # the limits of runner.serve.HttpProtocol, as serve.* sets them
             for k in ("body_timeout_s", "idle_timeout_s", "max_url_bytes", "max_header_bytes") if k in sc}
    settings = Settings(model=sc.model_name or f"eagle3-{served.key[:12]}",
                        chain=None if rt.chain is None else int(rt.chain), policy=str(rt.policy),
                        temperature=float(rt.temperature), seed=int(rt.seed), stop=tuple(rt.stop),
                        api_key=os.environ.get(API_KEY_ENV) or None, queue_size=int(sc.queue_size),
                        max_body_bytes=int(sc.max_body_bytes), stream_interval_s=float(sc.stream_interval_s),
                        **given)
    check_settings(settings)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    template = load_chat_template(target_dir)
    check_chat_template(encoder(tokenizer, template))
    sock = listen(str(sc.host), int(sc.port))
    try:
        engine = load_engine(cfg, upstream)
        app = create_app(engine, tokenizer, settings, chat_template=template)
        warm_up(engine, settings.chain)
    except BaseException:
        sock.close()
        raise
    run_server(app, sock=sock, drain_s=float(sc.drain_s),
               ready=lambda url: log.info("serving %s at %s (engine %s%s); SIGTERM or Ctrl-C stops it",
                                          settings.model, url, cfg.engine.kind,
                                          ", API key required" if settings.api_key else ""))
    finished = app.state.decoder.metrics.finished()
    log.info("server stopped: %d requests (%s)", sum(finished.values()),
             ", ".join(f"{k} {v}" for k, v in sorted(finished.items())) or "none")
    return {"requests": sum(finished.values()), **{f"finished_{k}": v for k, v in finished.items()}}
