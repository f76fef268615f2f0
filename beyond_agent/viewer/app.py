"""The viewer's web app: a JSON API over the experiment folder and the static page that draws it.

    GET /                      the page (static/index.html; plain HTML + JS, no build step)
    GET /vendor/plotly.min.js  plotly.js as shipped inside the `plotly` Python package (no CDN)
    GET /healthz               200 once serving
    GET /api/run               name, configs, versions, where the files are
    GET /api/panels            the dashboard's panels (title, y-axis unit) with the lines this run has for
                               each: {key, label, points}; keys under today's names (current_metric_key)
    GET /api/metrics?keys=a,b  [[step, value], ...] per key (all keys listed in `keys`)
    GET /api/steps             the dumped steps: [{step, kind}]
    GET /api/episodes?step=N&kind=train&offset=0&limit=50[&env=&task=&agent_task=&termination=&success=
                     &min_reward=&max_reward=&group=]
                               one page of a step's episode summaries, with each filter's values
    GET /api/episode?step=N&kind=train&line=L
                               one whole episode with its tokens, and the lines of its group

Errors are JSON `{"error": "..."}`: 400 for a bad parameter (naming it), 404 for a missing step or episode,
422 for a dump line that is not a trajectory record.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from envservice.childproc import host_allowed
from beyond_agent.trajectories import KINDS, TrajectoryFormatError
from beyond_agent.curves import PANELS
from beyond_agent.integrity import METRIC, MONITORS, SECTION, alarm_steps
from beyond_agent.viewer.episode_view import TokenTexts, episode_view
from beyond_agent.viewer.episodes import EpisodeNotFound, EpisodeStore
from beyond_agent.run_folder import MetricsLog, model_path_from_config, run_info, trajectory_folders

STATIC = Path(__file__).parent / "static"


def plotly_js() -> Path:
    """plotly.min.js from the installed `plotly` package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"the installed plotly package has no {path}; reinstall it (pip install plotly)")
    return path


class RunState:
    """The experiment folder's readers, shared by the request threads."""

    def __init__(self, folder: Path, tokenizer: str | None):
        self.folder = folder
        self.metrics = MetricsLog(folder)
        self.episodes = EpisodeStore(trajectory_folders(folder), root=folder)
        self.tokenizer_path = tokenizer or model_path_from_config(folder)
        self._texts: TokenTexts | None = None
        self.lock = threading.Lock()
        self._texts_lock = threading.Lock()  # loading a tokenizer takes seconds: it must not hold up the rest

    def refreshed_metrics(self) -> MetricsLog:
        """The metrics with every whole line written so far."""
        with self.lock:
            self.metrics.refresh()
        return self.metrics

    def refreshed_episodes(self) -> EpisodeStore:
        """The episode store, looking again for trajectory folders (a run may create its folder late)."""
        with self.lock:
            self.episodes.folders = trajectory_folders(self.folder)
        return self.episodes

    def texts(self) -> TokenTexts:
        """The tokenizer, loaded on first use (`create_app` starts that in the background)."""
        with self._texts_lock:
            if self._texts is None:
                self._texts = TokenTexts(self.tokenizer_path)
            return self._texts


ERROR_CHARS = 500
"""An error message's length at most: a message quotes the caller's input, never all of it."""


def _error(status: int, message: str) -> JSONResponse:
    if len(message) > ERROR_CHARS:
        message = f"{message[:ERROR_CHARS]}…[+{len(message) - ERROR_CHARS} chars]"
    return JSONResponse({"error": message}, status_code=status)


def _int(request: Request, name: str, default: int | None = None) -> int:
    value = request.query_params.get(name)
    if value in (None, ""):
        if default is None:
            raise ValueError(f"missing parameter {name} (an integer)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"parameter {name}={value!r}: expected an integer") from None


def _kind(request: Request) -> str:
    kind = request.query_params.get("kind") or "train"
    if kind not in KINDS:
        raise ValueError(f"parameter kind={kind!r}; valid: {', '.join(KINDS)}")
    return kind


def create_app(folder: Path, tokenizer: str | None = None, hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The viewer over `folder` (read live; see the module docstring). `hosts`: the Host header names it
    answers to (`envservice.childproc.allowed_hosts`; None: any), refused with 400 otherwise (DNS rebinding)."""
    state = RunState(folder, tokenizer)
    threading.Thread(target=state.texts, name="load-tokenizer", daemon=True).start()
    app = FastAPI(title="BeyondAgent run viewer", docs_url=None, redoc_url=None)
    app.state.run = state
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.middleware("http")
    async def known_hosts_only(request: Request, call_next):
        host = request.headers.get("host", "")
        if not host_allowed(host, hosts):
            return _error(400, f"Host {host[:100]!r} is not a name this viewer answers to (allowed: "
                               f"{', '.join(hosts)}); start it with --allowed-host NAME to add one")
        return await call_next(request)

    @app.exception_handler(ValueError)
    async def bad_parameter(request: Request, error: ValueError):
        if isinstance(error, TrajectoryFormatError):
            return _error(422, str(error))
        return _error(400, str(error))

    @app.exception_handler(EpisodeNotFound)
    async def not_found(request: Request, error: EpisodeNotFound):
        return _error(404, str(error))

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC / "index.html")

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly():
        return FileResponse(plotly_js(), media_type="text/javascript")

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "folder": str(folder)}

    @app.get("/api/run")
    def run():
        return {**run_info(folder), "tokenizer": state.tokenizer_path}

    @app.get("/api/panels")
    def panels():
        available = state.refreshed_metrics().keys()
        shown = [{"id": panel.id, "title": panel.title, "unit": panel.unit, "stacked": panel.stacked,
                  "y_range": panel.y_range,
                  "lines": [dataclasses.asdict(line) for line in lines]}
                 for panel in PANELS if (lines := panel.lines(available))]
        return {"panels": shown, "keys": available}

    @app.get("/api/metrics")
    def metrics(request: Request):
        log = state.refreshed_metrics()
        keys = [key for key in (request.query_params.get("keys") or "").split(",") if key]
        steps = sorted(log.steps)
        return {"series": log.series(keys), "steps": len(steps), "last_step": steps[-1] if steps else None,
                "last_update": log.last_update}

    @app.get("/api/integrity")
    def integrity():
        """The steps at which each integrity monitor fired (beyond_agent/integrity.py), for the run's banner."""
        series = state.refreshed_metrics().series([METRIC + name for name in MONITORS])
        return {"alarms": [{"monitor": name, "steps": steps} for name, steps in alarm_steps(series).items()],
                "setting": SECTION}

    @app.get("/api/steps")
    def steps():
        return {"steps": state.refreshed_episodes().steps()}

    @app.get("/api/episodes")
    def episodes(request: Request):
        params = dict(request.query_params)
        step, kind = _int(request, "step"), _kind(request)
        offset, limit = _int(request, "offset", 0), _int(request, "limit", 50)
        filters = {key: value for key, value in params.items() if key not in ("step", "kind", "offset", "limit")}
        return state.refreshed_episodes().page(step, kind, filters, offset, limit)

    @app.get("/api/episode")
    def episode(request: Request):
        step, kind, line = _int(request, "step"), _kind(request), _int(request, "line")
        store = state.refreshed_episodes()
        record = store.record(step, kind, line)
        view = episode_view(record, state.texts())
        return {**view, "line": line, "group_lines": store.group_lines(step, kind, record.group),
                "game_lines": store.game_lines(step, kind, record.group, record.index)}

    return app
